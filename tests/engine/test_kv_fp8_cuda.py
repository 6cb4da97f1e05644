"""The FP8 KV cache on CUDA (not run in development: no GPU there; the device run's CUDA tests): the
fused backends' self-check over an FP8 cache, and the engine (compiled triton decode kernel loading e4m3,
decode CUDA graphs) against the bf16 cache, by first divergence."""

from __future__ import annotations

import pytest
import torch

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.attention import attn_select
from bulkgen.engine.attention.layer_attention import FULL, AttnKind, LayerAttention
from bulkgen.engine.kv import kv_cache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LAYERS = {  # real head sizes
    "dense": LayerAttention(FULL, 2, 64, 64, q_heads=8),
    "window and sinks (gpt-oss)": LayerAttention(AttnKind(window=128), 8, 64, 64, sinks=True, q_heads=64),
    "MLA (DeepSeek-V3)": LayerAttention(FULL, 16, 192, 128, q_heads=16),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_fused_backend_passes_its_self_check_over_an_fp8_cache(name):
    """The probes write and read an FP8 cache (attn_select); varlen_paged, which reads the cache itself
    without per-row scales, is refused for it by name."""
    chosen = attn_select.select_backend(
        torch.device("cuda"), torch.bfloat16, [LAYERS[name]], 16, kv_cache.FP8
    )
    print(f"{name}: chose {chosen.name}, {chosen.probe_report}")
    assert chosen.name not in ("plain", "varlen_paged"), chosen.probe_report
    assert "FP8" in chosen.probe_report.get("varlen_paged", "FP8")


def test_cuda_engine_with_an_fp8_cache_against_the_bf16_cache(model_dirs, mixed_prompts):
    prompts = mixed_prompts(seed=34, count=8, low=1, high=200)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    kw = dict(device="cuda", dtype=torch.bfloat16, num_kv_blocks=4096, block_size=16, max_num_seqs=8)
    bf16 = Engine.from_pretrained(str(model_dirs["llama"]), **kw)
    fp8 = Engine.from_pretrained(str(model_dirs["llama"]), kv_cache_dtype="fp8", **kw)
    assert isinstance(fp8.runner.k_caches[0], kv_cache.Fp8Cache) and fp8.runner.graphs is not None
    want = [o.token_ids for o in bf16.generate(prompts, params)]
    got = [o.token_ids for o in fp8.generate(prompts, params)]
    first = [
        next((i for i, (a, b) in enumerate(zip(w, g, strict=True)) if a != b), None)
        for w, g in zip(want, got, strict=True)
    ]
    print(f"FP8 KV cache vs bf16 cache on CUDA ({fp8.runner.backend.name}), first differing token: {first}")
    assert sum(f is None or f >= 4 for f in first) >= len(first) // 2, first
