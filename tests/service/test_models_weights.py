"""/v1/models says how the workers hold each served model: its quantization, weight dtype and KV-cache
dtype, a quantized checkpoint beside a float one in one service (the real openai client over uvicorn)."""

from __future__ import annotations

import pytest

from bulkgen.lab.quantized import write_compressed_fp8
from bulkgen.lab.tiny import build_tiny_model
from bulkgen.settings import WorkerSettings
from bulkgen.store import LocalStore
from tests.service.api_only import ApiOnly


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    plain = build_tiny_model(root / "plain", arch="llama", seed=2)
    return {"plain": str(plain), "ct-fp8": str(write_compressed_fp8(plain, root / "ct", "channel"))}


def _models(tmp_path, checkpoints, **settings) -> dict:
    api = ApiOnly(
        LocalStore(str(tmp_path / "store")), models={**checkpoints, "remote": "s3://b/m"}, **settings
    )
    try:
        client = api.client()
        listed = {m.id: m.model_extra for m in client.models.list()}
        assert client.models.retrieve("plain").model_extra == listed["plain"]
        return {
            name: {k: extra[k] for k in ("quantization", "weight_dtype", "kv_cache_dtype")}
            for name, extra in listed.items()
        }
    finally:
        api.stop()


def test_models_report_quantization_and_dtypes(tmp_path, checkpoints):
    assert _models(tmp_path, checkpoints) == {
        "plain": {"quantization": None, "weight_dtype": "auto", "kv_cache_dtype": "auto"},
        "ct-fp8": {
            "quantization": "compressed-tensors",
            "weight_dtype": "float8_e4m3fn",
            "kv_cache_dtype": "auto",
        },
        "remote": {"quantization": "unknown", "weight_dtype": "unknown", "kv_cache_dtype": "auto"},
    }


def test_online_fp8_shows_on_every_float_model(tmp_path, checkpoints):
    workers = WorkerSettings(engine_kwargs={"quantize": "fp8"})
    models = _models(tmp_path, {"plain": checkpoints["plain"]}, workers=workers)
    assert models["plain"] == {
        "quantization": "fp8-online",
        "weight_dtype": "float8_e4m3fn",
        "kv_cache_dtype": "auto",
    }
