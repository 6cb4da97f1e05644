"""CUDA path (untested in development: no GPU there). Runs only where a CUDA device exists."""

from __future__ import annotations

import pytest
import torch

from bulkgen.engine import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_fp32_greedy_matches_cpu_reference(arch, model_dirs, reference, mixed_prompts):
    prompts = mixed_prompts(seed=30, count=6, low=1, high=80)
    engine = Engine.from_pretrained(str(model_dirs[arch]), device="cuda", dtype=torch.float32,
                                    max_num_batched_tokens=64, block_size=8)
    outs = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference.greedy(arch, prompt, 8)
    sampled = engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=3))
    assert all(len(o.token_ids) >= 1 for o in sampled)
