"""`bulkgen plan` with an FP8 KV cache: the profile records the engine's KV cache (its dtype, the bytes a
token takes with the FP8 scales counted, the tokens its blocks held), each KV dtype keeps its own profile,
and the plan says what the cache costs."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from transformers import AutoConfig

from bulkgen.cli import cli
from bulkgen.models.registry import DEFAULT_MODEL_NAME, default_model_path
from bulkgen.plan import profile as profiles
from bulkgen.store import open_store

SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def test_the_profile_records_the_engines_fp8_kv_cache(monkeypatch):
    """Bytes per token from the model's config: every layer's K and V, one byte an element plus a
    float32 scale per token and KV head (bf16 or float32 would be 2 or 4 bytes an element, no scale)."""
    monkeypatch.setattr(profiles, "BATCH_SIZES", (1,))  # the record, not the figures: a small grid
    monkeypatch.setattr(profiles, "CONTEXTS", (32,))
    monkeypatch.setattr(profiles, "CHURN_ROUNDS", 1)
    config = AutoConfig.from_pretrained(default_model_path())
    head_dim = config.hidden_size // config.num_attention_heads
    fp8 = profiles.measure_here(DEFAULT_MODEL_NAME, default_model_path(), {"kv_cache_dtype": "fp8_e4m3"})
    assert (fp8.device, fp8.kv_cache_dtype) == ("cpu-kv-fp8", "fp8")
    per_layer = config.num_key_value_heads * 2 * (head_dim + 4)
    assert fp8.kv_bytes_per_token == config.num_hidden_layers * per_layer
    assert fp8.kv_cache_tokens > 0 and fp8.kv_cache_tokens % fp8.block_size == 0


def _stored(kv: str, bytes_per_token: int, tokens: int) -> profiles.Profile:
    device = profiles.device_key("cpu", kv)
    return profiles.Profile(
        "bulkgen-tiny", device, 0.004, 1e-4, 8e-5, 1e-6, 64, 2048, 512, 16, 0.4,
        kv_cache_dtype=kv, kv_bytes_per_token=bytes_per_token, kv_cache_tokens=tokens,
    )  # fmt: skip


def test_plan_takes_the_profile_of_its_kv_dtype_and_counts_its_bytes(tmp_path):
    store = open_store(str(tmp_path))
    profiles.save(store, _stored("auto", 16384, 32768))
    profiles.save(store, _stored("fp8", 4608, 116480))
    args = ["plan", str(SAMPLES / "chat.jsonl"), "--storage", str(tmp_path), "--gpu", "cpu"]
    plans = {}
    for kv in ("auto", "fp8"):
        result = CliRunner().invoke(cli, [*args, "--kv-cache-dtype", kv, "--json"])
        assert result.exit_code == 0, result.output
        plans[kv] = json.loads(result.output)
        assert plans[kv]["profile"]["measured_now"] is False
    assert plans["auto"]["kv_cache"] == {"dtype": "auto", "bytes_per_token": 16384, "tokens": 32768}
    assert plans["fp8"]["kv_cache"] == {"dtype": "fp8", "bytes_per_token": 4608, "tokens": 116480}
    assert plans["fp8"]["profile"]["stored_at"].endswith("/cpu-kv-fp8.json")
    text = CliRunner().invoke(cli, [*args, "--kv-cache-dtype", "fp8"]).output
    assert "fp8 (e4m3 + a scale per token and head): 4,608 bytes per token" in text
    assert "held 116,480 tokens (511.9 MiB)" in text
    refused = CliRunner().invoke(cli, [*args, "--kv-cache-dtype", "int4"])
    assert refused.exit_code == 2 and "'int4' is not one of 'auto', 'fp8', 'fp8_e4m3'" in refused.output
