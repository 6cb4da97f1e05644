"""Per-rank memory of a model split over N GPUs, from a Llama-3-70B-shaped config alone (no weights):
`bulkgen plan --tensor-parallel N`, and the refusal at load of a model that does not fit one GPU."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import LlamaConfig

from bulkgen.cli import cli
from bulkgen.engine.parallel.rank_memory import GIB, check_fits, rank_memory
from bulkgen.lab.tiny import build_tokenizer

# Llama-3-70B: 70,553,706,496 parameters, 2 bytes each in bf16
SHAPE = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
PARAMS = 70_553_706_496
H200_FREE = 140 * GIB


@pytest.fixture(scope="module")
def config():
    return LlamaConfig(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=131072, **SHAPE)


def test_each_rank_holds_its_share_of_a_70b_model(config):
    one, two = (rank_memory(config, n, torch.bfloat16) for n in (1, 2))
    assert one["weight_bytes"] == 2 * PARAMS
    # bytes: half the split parameters, plus the norms (161 vectors of 8,192) whole on each rank
    assert two["weight_bytes"] == 2 * ((PARAMS - 161 * 8192) // 2 + 161 * 8192)
    # 80 layers x K and V x 8 KV heads of 128 x 2 bytes, halved per rank
    assert (one["kv_bytes_per_token"], two["kv_bytes_per_token"]) == (327_680, 163_840)
    sixteen = rank_memory(config, 16, torch.bfloat16)  # more ranks than KV heads: each keeps one
    assert sixteen["kv_bytes_per_token"] == 80 * 2 * 128 * 2


def test_a_model_too_large_for_one_gpu_is_refused_naming_its_memory_and_the_flag(config):
    with pytest.raises(ValueError) as refused:
        check_fits("/models/llama-70b", config, torch.bfloat16, 1, H200_FREE, "cuda:0")
    message = str(refused.value)
    assert "131.4 GiB" in message and "140.0 GiB free" in message and "--tensor-parallel 2" in message
    check_fits("/models/llama-70b", config, torch.bfloat16, 2, H200_FREE, "cuda:0")  # 65.7 GiB per rank


def test_bulkgen_plan_prints_per_rank_memory_from_a_config_alone(config, tmp_path):
    config.save_pretrained(tmp_path / "llama-70b")
    build_tokenizer().save_pretrained(tmp_path / "llama-70b")
    batch = tmp_path / "in.jsonl"
    batch.write_text(
        json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "hi"}}) + "\n"
    )
    runner = CliRunner()
    args = ["plan", str(batch), "--model", f"llama-70b={tmp_path / 'llama-70b'}", "--tensor-parallel"]
    result = runner.invoke(cli, [*args, "2"])
    assert result.exit_code == 0, result.output
    assert "65.7 GiB of bfloat16 weights on each of 2 GPUs (whole model 131.4 GiB)" in result.output
    assert "160 KiB per token" in result.output
    refused = runner.invoke(cli, [*args, "3"])
    assert refused.exit_code == 2 and "does not divide the model's num_attention_heads (64)" in refused.output
