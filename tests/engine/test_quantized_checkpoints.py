"""Quantized checkpoints load through transformers' quantizers into the engine: compressed-tensors FP8
(written with the compressed-tensors package: per-tensor, per-channel and block scales) gives
transformers' greedy tokens and logprobs; a method whose package is missing is one clear error; nothing
can fetch kernels from the hub."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.model.loading import load_model
from bulkgen.engine.model.quantize import Fp8Linear
from bulkgen.lab.quantized import write_bitsandbytes, write_block_fp8, write_compressed_fp8, write_mxfp4
from bulkgen.lab.tiny import build_tiny_model
from tests.support.logprobs import assert_follows

pytestmark = pytest.mark.upstream  # also on the lower bound and the canary (README: tested ranges)


@pytest.fixture(scope="module")
def fp8_checkpoints(model_dirs, tmp_path_factory):
    """The tiny llama (hidden 64, MLP 128) as compressed-tensors FP8 with each scale layout."""
    root = tmp_path_factory.mktemp("ct-fp8")
    return {
        strategy: write_compressed_fp8(model_dirs["llama"], root / strategy, strategy, block=32)
        for strategy in ("tensor", "channel", "block")
    }


def _stored_dtypes(path) -> dict[str, torch.dtype]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}


def _greedy_equals_generate(path, float_dir, prompts, device_map: dict | None = None, max_tokens: int = 6):
    """The engine's greedy tokens and their logprobs are transformers' on the same checkpoint (mixed
    packed steps), and the logprobs are not the float model's: the quantized weights made them."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **(device_map or {})).eval()
    float_model = AutoModelForCausalLM.from_pretrained(float_dir).eval()
    engine = Engine.from_pretrained(
        str(path), device="cpu", max_num_seqs=4, max_num_batched_tokens=32, block_size=8
    )
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0))
    assert any(r["prefill_tokens"] and r["decode_tokens"] for r in engine.pop_step_records())
    off_float = assert_follows(hf, prompts, outs, max_tokens, float_model)
    assert off_float > 1e-3
    return engine


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_compressed_tensors_fp8_greedy_equals_generate(strategy, fp8_checkpoints, model_dirs, mixed_prompts):
    path = fp8_checkpoints[strategy]
    stored = _stored_dtypes(path)
    assert stored["model.layers.0.self_attn.q_proj.weight"] == "F8_E4M3"
    assert "model.layers.1.mlp.down_proj.weight_scale" in stored and stored["lm_head.weight"] != "F8_E4M3"
    _greedy_equals_generate(path, model_dirs["llama"], mixed_prompts(seed=21, count=6, low=1, high=70))


def test_fine_grained_fp8_greedy_equals_generate(model_dirs, mixed_prompts, tmp_path):
    """Block FP8 (`quant_method: fp8`): on CPU transformers dequantizes it at load (its kernels are CUDA's)."""
    path = write_block_fp8(model_dirs["llama"], tmp_path / "block", block=32)
    assert _stored_dtypes(path)["model.layers.0.mlp.up_proj.weight"] == "F8_E4M3"
    _greedy_equals_generate(
        path, model_dirs["llama"], mixed_prompts(seed=23, count=6, low=1, high=70), {"device_map": "cpu"}
    )


def test_mxfp4_gpt_oss_greedy_equals_generate(mixed_prompts, tmp_path):
    """gpt-oss' MXFP4 experts: without hub kernels they are dequantized at load, on every device. The
    reference asks transformers for that too: from 5.25, which installs `kernels`, its own default fetches
    the triton kernels from the hub."""
    from transformers import Mxfp4Config

    float_dir = build_tiny_model(tmp_path / "gpt-oss", arch="gpt_oss", seed=1)
    path = write_mxfp4(float_dir, tmp_path / "mxfp4")
    assert _stored_dtypes(path)["model.layers.0.mlp.experts.gate_up_proj_blocks"] == "U8"
    reference = {"device_map": "cpu", "quantization_config": Mxfp4Config(dequantize=True)}
    _greedy_equals_generate(path, float_dir, mixed_prompts(seed=24, count=6, low=1, high=70), reference)


@pytest.mark.parametrize("bits, layer", [(8, "Linear8bitLt"), (4, "Linear4bit")])
def test_bitsandbytes_greedy_equals_generate(bits, layer, model_dirs, mixed_prompts, tmp_path):
    """bitsandbytes runs on CPU (its CPU backend, >= 0.46): a checkpoint transformers saved quantized."""
    path = write_bitsandbytes(model_dirs["llama"], tmp_path / f"bnb{bits}", bits)
    prompts = mixed_prompts(seed=22, count=6, low=1, high=70)
    engine = _greedy_equals_generate(path, model_dirs["llama"], prompts, {"device_map": "cpu"})
    assert type(engine.model.model.layers[0].self_attn.q_proj).__name__ == layer


def _with_quant_config(src, dst, quant: dict):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return dst


@pytest.mark.parametrize(
    "method, extra",
    [("awq", "awq"), ("gptq", "gptq")],
)
def test_a_missing_quantizer_package_names_the_extra(method, extra, model_dirs, tmp_path):
    path = _with_quant_config(model_dirs["llama"], tmp_path / method, {"quant_method": method, "bits": 4})
    with pytest.raises(
        ImportError, match=rf"quantized with '{method}', which needs .*pip install 'bulkgen\[{extra}\]'"
    ):
        Engine.from_pretrained(str(path), device="cpu")


def test_online_fp8_leaves_a_quantized_checkpoint_its_own_format(fp8_checkpoints):
    """`--quantize fp8` is one setting for every served model: a checkpoint already quantized loads as
    its quantizer makes it (no Fp8Linear), so it can be served beside float models quantized online."""
    model = load_model(fp8_checkpoints["channel"], "cpu", torch.float32, quantize="fp8")
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    assert getattr(model, "hf_quantizer", None) is not None
    engine = Engine.from_pretrained(str(fp8_checkpoints["channel"]), device="cpu", quantize="fp8")
    assert not any(isinstance(m, Fp8Linear) for m in engine.model.modules())


def test_loading_switches_hub_kernels_off(model_dirs, monkeypatch):
    """With the `kernels` package installed transformers starts with hub kernels on and its lazy loader
    fetches from the hub; after a load it never does."""
    from transformers.integrations import hub_kernels

    for name in ("USE_HUB_KERNELS", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)  # restored after the test: load_model sets both
    fetched = []
    if isinstance(hub_kernels._kernels_enabled, bool):  # before 5.25: the variable read once, at import
        monkeypatch.setattr(hub_kernels, "_kernels_enabled", True)
    monkeypatch.setattr(hub_kernels, "is_kernels_available", lambda *a, **k: True)
    monkeypatch.setattr(hub_kernels, "get_kernel", lambda *a, **k: fetched.append(a))
    hub_kernels.lazy_load_kernel("finegrained-fp8", mapping={})
    assert fetched, "without the switch a hub fetch happens (this test could not see one otherwise)"
    fetched.clear()
    load_model(model_dirs["llama"], "cpu", torch.float32)
    assert hub_kernels.lazy_load_kernel("finegrained-fp8", mapping={}) is None
    assert fetched == []
    assert os.environ["USE_HUB_KERNELS"] == "NO" and os.environ["HF_HUB_OFFLINE"] == "1"
