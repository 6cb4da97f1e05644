"""Quantized weights on CUDA (the device run): online FP8 through cuBLASLt's row-wise FP8 GEMM, its
load peak on the device, and a compressed-tensors FP8 checkpoint kept in FP8 by transformers'
`use_optimized_inference`. bf16 runs are judged against transformers over the same quantized modules
as tests/support/divergence.py judges any bf16 run (most prompts identical, early partings near-ties)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.model.loading import load_model
from bulkgen.engine.model.quantize import Fp8Linear, quantize_layers, weight_bytes
from bulkgen.lab.quantized import write_compressed_fp8
from bulkgen.lab.tiny import build_tiny_model
from tests.support.divergence import judge_bf16_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NUM_KV_BLOCKS = 2048


def _bf16_greedy(path, prompts, hf, **engine_kwargs):
    engine = Engine.from_pretrained(
        str(path), device="cuda", dtype=torch.bfloat16, num_kv_blocks=NUM_KV_BLOCKS, **engine_kwargs
    )
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    want = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            out = hf.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
            want.append(out[0, len(prompt) :].tolist())
    return engine, judge_bf16_run(hf, prompts, want, got)


def test_cuda_online_fp8_runs_scaled_mm_and_follows_generate(model_dirs, mixed_prompts):
    hf = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.bfloat16).eval()
    quantize_layers(hf, "cuda")
    prompts = mixed_prompts(seed=41, count=12, low=1, high=200)
    engine, (firsts, margins, problems) = _bf16_greedy(model_dirs["llama"], prompts, hf, quantize="fp8")
    layers = [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.use_scaled_mm for m in layers)  # the FP8 GEMM, not the dequantized product
    print(f"online fp8 bf16 first divergence per prompt: {firsts}, margins {margins}")
    assert not problems, (problems, firsts, margins)


def test_cuda_fp32_online_fp8_equals_generate(model_dirs, mixed_prompts):
    """fp32 has no row-wise FP8 GEMM on CUDA: the dequantized product, token for token."""
    hf = AutoModelForCausalLM.from_pretrained(model_dirs["llama"]).eval()
    quantize_layers(hf, "cuda")
    prompts = mixed_prompts(seed=42, count=6, low=1, high=120)
    engine = Engine.from_pretrained(
        str(model_dirs["llama"]),
        device="cuda",
        dtype=torch.float32,
        quantize="fp8",
        num_kv_blocks=NUM_KV_BLOCKS,
    )
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8, do_sample=False)
        assert out.token_ids == want[0, len(prompt) :].tolist()


def test_cuda_online_fp8_load_peak_is_fp8_plus_one_layer(tmp_path):
    path = build_tiny_model(tmp_path / "m", arch="llama", seed=5, hidden_size=512, intermediate_size=2048,
                            num_hidden_layers=8)  # fmt: skip
    host = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    layer = sum(p.numel() * p.element_size() for p in host.model.layers[0].parameters())
    largest = max(m.weight.numel() for m in host.model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    del host
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = load_model(path, "cuda", torch.bfloat16, quantize="fp8")
    peak = torch.cuda.max_memory_allocated() - before
    held = weight_bytes(model)
    print(f"fp8 weights {held} B, one bf16 layer {layer} B, load peak {peak} B")
    assert peak <= held + layer + 4 * largest + (1 << 20), (peak, held, layer)  # + one fp32 copy, slack


def test_cuda_compressed_tensors_fp8_stays_fp8(model_dirs, mixed_prompts, tmp_path):
    path = write_compressed_fp8(model_dirs["llama"], tmp_path / "ct", "channel")
    hf = load_model(path, "cuda", torch.bfloat16)
    q_proj = hf.model.layers[0].self_attn.q_proj
    print(f"compressed-tensors on CUDA: {type(q_proj).__name__}, weight {q_proj.weight.dtype}")
    prompts = mixed_prompts(seed=43, count=12, low=1, high=200)
    engine, (firsts, margins, problems) = _bf16_greedy(path, prompts, hf)
    assert engine.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    print(f"compressed-tensors fp8 bf16 first divergence per prompt: {firsts}, margins {margins}")
    assert not problems, (problems, firsts, margins)
