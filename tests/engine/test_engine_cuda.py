"""CUDA path (not run in development: no GPU there). Runs only where a CUDA device exists.

Tolerances: fp32 on CUDA must equal the CPU reference token for token (the plain backend runs in
fp32; TF32 is off by default). bf16 is compared with transformers' own bf16 `generate` on the same
GPU by first divergence: with 16 new tokens per prompt, at least half the prompts identical and no
divergence before position 2 (a wrong mask or cache layout diverges at position 0 or 1).
"""

from __future__ import annotations

import statistics

import pytest
import torch
from transformers import AutoModelForCausalLM

from bulkgen.engine import Engine, SamplingParams, attn_select
from bulkgen.engine.attn_backends import BACKENDS, cuda_candidates

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_fp32_greedy_matches_cpu_reference(arch, model_dirs, reference, mixed_prompts):
    prompts = mixed_prompts(seed=30, count=6, low=1, high=80)
    engine = Engine.from_pretrained(str(model_dirs[arch]), device="cuda", dtype=torch.float32,
                                    max_num_batched_tokens=64, block_size=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference.greedy(arch, prompt, 8)


def test_every_fused_candidate_matches_plain_in_bf16():
    names = cuda_candidates()
    assert names, "this torch offers no fused varlen attention on CUDA"
    for name in names:
        for block_size in (16, 256):
            error = attn_select.self_check(BACKENDS[name](), torch.device("cuda"), torch.bfloat16, 8, 2, 64, block_size)
            print(f"{name} block_size={block_size}: {error or 'ok'}")
    chosen = attn_select.select_backend(torch.device("cuda"), torch.bfloat16, 8, 2, 64, 16)
    assert chosen.name != "plain", "no fused backend passed its self-check"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_bf16_greedy_follows_hf_generate(arch, model_dirs, mixed_prompts):
    prompts = mixed_prompts(seed=31, count=12, low=1, high=300)
    engine = Engine.from_pretrained(str(model_dirs[arch]), device="cuda", dtype=torch.bfloat16,
                                    max_num_batched_tokens=256, block_size=16)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.bfloat16).cuda().eval()
    firsts = []
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, min_new_tokens=16,
                                 do_sample=False, eos_token_id=None)[0, len(prompt) :].tolist()
        firsts.append(next((i for i, (a, b) in enumerate(zip(ref, out.token_ids, strict=True)) if a != b), 16))
    print(f"{arch} bf16 first divergence per prompt: {firsts}, backend {engine.runner.backend.name}")
    assert sum(f == 16 for f in firsts) >= len(firsts) / 2, firsts
    assert min(firsts) >= 2, firsts
    assert statistics.median(firsts) >= 8, firsts


def test_cuda_seeded_sampling_is_the_same_alone_and_in_a_crowd(model_dirs, mixed_prompts):
    prompts = mixed_prompts(seed=32, count=6, low=3, high=120)
    engine = Engine.from_pretrained(str(model_dirs["llama"]), device="cuda", dtype=torch.float32)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=77, ignore_eos=True)
    alone = engine.generate([prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=1.0, top_k=5, ignore_eos=True) for n in (3, 20, 7, 15, 9)]
    crowd = engine.generate(prompts, [seeded, *others])
    assert crowd[0].token_ids == alone
    pair = engine.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.8, seed=5, n=2,
                                                        ignore_eos=True))[0]
    six = engine.generate([prompts[0]], SamplingParams(max_tokens=12, temperature=0.8, seed=6, ignore_eos=True))[0]
    assert pair.outputs[1].token_ids != six.outputs[0].token_ids


def test_cuda_defaults_fill_the_gpu(model_dirs):
    engine = Engine.from_pretrained(str(model_dirs["llama"]), device="cuda")
    free = torch.cuda.mem_get_info()[0]
    assert engine.config.max_num_seqs >= 128 and engine.config.max_num_batched_tokens >= 4096
    assert engine.runner.num_blocks * engine.config.block_size > 10_000 or free < 8 << 30
