"""What the runtime needs from the engine: reset, tags in step records, free capacity, sized defaults,
and the attention backend choice (CPU side of the device path)."""

from __future__ import annotations

import pytest
import torch

from bulkgen.engine import SamplingParams
from bulkgen.engine.attention import attn_select
from bulkgen.engine.attention.attn_backends import PlainBackend
from bulkgen.engine.attention.layer_attention import FULL, AttnKind, LayerAttention
from bulkgen.engine.config import EngineConfig, resolve_limits
from tests.support.attention import reference_varlen


def dense(q_heads: int, kv_heads: int, dim: int) -> LayerAttention:
    """A plain full-attention layer as the probe would find it."""
    return LayerAttention(FULL, kv_heads, dim, dim, q_heads=q_heads)


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_reset_drops_everything_and_the_engine_works_after(make_engine, reference, mixed_prompts):
    prompts = mixed_prompts(seed=50, count=4, low=5, high=40)
    engine = make_engine("llama", max_num_batched_tokens=32, block_size=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, _greedy(5))
    engine.step()
    engine.step()
    engine.reset()
    assert not engine.has_unfinished()
    assert engine.free_capacity()["free_blocks"] == engine.runner.num_blocks
    outs = engine.generate(prompts, _greedy(5))
    assert [o.token_ids for o in outs] == [reference.greedy("llama", p, 5) for p in prompts]


def test_step_records_count_work_per_tag(make_engine, mixed_prompts):
    prompts = mixed_prompts(seed=51, count=5, low=5, high=20)
    engine = make_engine("llama", max_num_seqs=4)
    for i, p in enumerate(prompts):
        engine.add_request(
            str(i), p, _greedy(3 + i), tag="batch-a" if i < 3 else ("batch-b" if i == 3 else None)
        )
    while engine.has_unfinished():
        engine.step()
    records = engine.pop_step_records()
    totals: dict[str, dict[str, int]] = {}
    for r in records:
        assert sum(t["held"] for t in r["by_tag"].values()) == r["num_seqs"]
        assert sum(t["active"] for t in r["by_tag"].values()) == r["active_seqs"]
        assert sum(t["prefill_tokens"] for t in r["by_tag"].values()) == r["prefill_tokens"]
        assert sum(t["decode_tokens"] for t in r["by_tag"].values()) == r["decode_tokens"]
        for tag, counts in r["by_tag"].items():
            for key, value in counts.items():
                totals.setdefault(tag, {}).setdefault(key, 0)
                totals[tag][key] += value
    assert set(totals) == {"batch-a", "batch-b", ""}
    assert totals["batch-a"]["output_tokens"] == 3 + 4 + 5
    assert totals["batch-b"]["output_tokens"] == 6 and totals[""]["output_tokens"] == 7
    assert totals["batch-a"]["prefill_tokens"] == sum(len(p) for p in prompts[:3])


def test_free_capacity_tracks_slots_blocks_and_waiting(make_engine, mixed_prompts):
    engine = make_engine("llama", max_num_seqs=3, block_size=4, num_kv_blocks=64)
    empty = engine.free_capacity()
    assert empty == {"free_slots": 3, "free_blocks": 64, "waiting": 0, "block_size": 4, "max_num_seqs": 3}
    for i, p in enumerate(mixed_prompts(seed=52, count=2, low=6, high=6)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=i))
    cap = engine.free_capacity()
    assert cap["waiting"] == 4 and cap["free_slots"] == -1
    engine.step()
    cap = engine.free_capacity()
    running = len(engine.scheduler.running)
    assert 0 < running <= 3 and cap["waiting"] == 4 - running
    assert cap["free_slots"] == -1 and cap["free_blocks"] < 64
    while engine.has_unfinished():
        engine.step()
    assert engine.free_capacity() == empty


def test_defaults_are_modest_on_cpu_and_fill_a_large_gpu(monkeypatch):
    cpu = resolve_limits(EngineConfig(), torch.device("cpu"))
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (64, 2048)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (120 << 30, 141 << 30))
    big = resolve_limits(EngineConfig(), torch.device("cuda"))
    assert (big.max_num_seqs, big.max_num_batched_tokens) == (512, 16384)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 << 30, 24 << 30))
    mid = resolve_limits(EngineConfig(max_num_seqs=100), torch.device("cuda"))
    assert (mid.max_num_seqs, mid.max_num_batched_tokens) == (100, 8192)


class _Broken(PlainBackend):
    name = "broken"

    def attend(self, q, k, v, k_cache, v_cache, meta, scale, softcap=None, sinks=None):
        return super().attend(q, k, v, k_cache, v_cache, meta, scale) * 1.01


def test_backend_choice_keeps_only_candidates_that_match_plain(monkeypatch):
    assert (
        attn_select.select_backend(torch.device("cpu"), torch.float32, [dense(4, 2, 16)], 8).name == "plain"
    )
    args = (torch.device("cpu"), torch.float32, dense(4, 2, 16), 8)
    assert attn_select.self_check(PlainBackend(), *args) is None
    assert "error" in attn_select.self_check(_Broken(), *args)
    monkeypatch.setenv("BULKGEN_ATTENTION", "nope")
    with pytest.raises(ValueError, match="BULKGEN_ATTENTION"):
        attn_select.select_backend(torch.device("cpu"), torch.float32, [dense(4, 2, 16)], 8)


def test_static_decode_buffers_give_the_reference_tokens(make_engine, reference, mixed_prompts):
    """The CUDA-graph decode path (padded static buckets, scratch slot), run eagerly on CPU."""
    from bulkgen.engine.decode_graphs import bucket, buckets_up_to

    assert [bucket(n, 512) for n in (1, 2, 3, 5, 7, 64, 65, 97, 500, 512)] == [
        1,
        2,
        3,
        6,
        8,
        64,
        96,
        128,
        512,
        512,
    ]
    assert bucket(300, 256) == 256
    assert buckets_up_to(20) == [1, 2, 3, 4, 6, 8, 12, 16, 20]
    prompts = mixed_prompts(seed=53, count=7, low=1, high=70)
    engine = make_engine("qwen2", cuda_graphs=True, max_num_seqs=5, block_size=4, max_num_batched_tokens=48)
    outs = engine.generate(prompts, [_greedy(n) for n in (3, 9, 5, 12, 1, 7, 10)])
    assert [o.token_ids for o in outs] == [
        reference.greedy("qwen2", p, n) for p, n in zip(prompts, (3, 9, 5, 12, 1, 7, 10), strict=True)
    ]
    assert len(engine.runner.graphs.buckets) >= 2
    assert engine.runner.graphs.capture(max_context=40) == len(engine.runner.graphs.buckets) >= 4 * 3
    assert engine.runner.k_caches[0].shape[0] == engine.runner.num_blocks + 1


PROBED_LAYERS = {
    "dense": dense(8, 2, 16),
    "sliding window": LayerAttention(AttnKind(window=32), 2, 16, 16, q_heads=8),
    "chunked": LayerAttention(AttnKind(chunk=32), 2, 16, 16, q_heads=8),
    "sinks": LayerAttention(FULL, 2, 16, 16, sinks=True, q_heads=8),
    "window and sinks": LayerAttention(AttnKind(window=128), 2, 16, 16, sinks=True, q_heads=8),
    "MLA (K 24, V 16)": LayerAttention(FULL, 4, 24, 16, q_heads=4),
}


@pytest.mark.parametrize("name", list(PROBED_LAYERS))
def test_cuda_backends_metadata_on_cpu_with_reference_kernels(monkeypatch, name):
    """The CUDA backends' packing (cumulative lengths, gathered context rows, block tables, window sizes,
    chunk pieces, the sink correction from the log-sum-exp, V padding) checked on CPU by putting float64
    reference kernels with flash's semantics where the CUDA-only ones would run; a backend that says it
    cannot take a layer is not checked on it."""
    from bulkgen.engine.attention import attn_backends

    def fake_flash(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left=-1):
        assert k.shape[1] == q.shape[1] and max_q == int((cu_q[1:] - cu_q[:-1]).max())
        assert v.shape[-1] == q.shape[-1], "flash takes V heads as wide as K heads"
        return reference_varlen(q, k, v, cu_q, cu_k, scale, window_left)

    def fake_paged(q, k_cache, v_cache, meta, scale, lse=False):
        bs, rows, k_parts, v_parts, cu_k = k_cache.shape[1], [], [], [], [0]
        for i, used in enumerate(meta.seqused_k.tolist()):
            table = meta.block_table[i]
            rows = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(used)])
            k_parts.append(k_cache.view(-1, *k_cache.shape[2:])[rows])
            v_parts.append(v_cache.view(-1, *v_cache.shape[2:])[rows])
            cu_k.append(cu_k[-1] + used)
        assert cu_k == meta.cu_k.tolist()
        k, v = torch.cat(k_parts), torch.cat(v_parts)
        out, logsumexp = reference_varlen(q, k, v, meta.cu_q, cu_k, scale, meta.window_left)
        return out, logsumexp if lse else None

    monkeypatch.setattr(attn_backends, "flash_varlen", fake_flash)
    monkeypatch.setattr(attn_backends, "varlen_paged", fake_paged)
    layer, checked = PROBED_LAYERS[name], 0
    for backend in (attn_backends.FlashVarlenBackend(), attn_backends.VarlenPagedBackend()):
        if backend.supports(layer) is not None:
            continue
        checked += 1
        for block_size in (4, 16):
            assert (
                attn_select.self_check(backend, torch.device("cpu"), torch.float32, layer, block_size) is None
            )
    assert checked >= 1, "no fused backend takes this layer"


def test_a_fused_backend_that_gets_windows_or_sinks_wrong_is_rejected(monkeypatch):
    """The probe runs each layer's own window and sinks: a flash kernel that ignored either would pass a
    dense probe and still be caught."""
    from bulkgen.engine.attention import attn_backends

    def ignores_window(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left=-1):
        return reference_varlen(q, k, v, cu_q, cu_k, scale)

    def forgets_lse(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left=-1):
        out, lse = reference_varlen(q, k, v, cu_q, cu_k, scale, window_left)
        return out, torch.zeros_like(lse)

    cpu, backend = torch.device("cpu"), attn_backends.FlashVarlenBackend(decode_kernel="padded")
    monkeypatch.setattr(attn_backends, "flash_varlen", ignores_window)
    assert attn_select.self_check(backend, cpu, torch.float32, PROBED_LAYERS["dense"], 4) is None
    assert "prefill kernel" in attn_select.self_check(
        backend, cpu, torch.float32, PROBED_LAYERS["sliding window"], 4
    )
    monkeypatch.setattr(attn_backends, "flash_varlen", forgets_lse)
    assert "prefill kernel" in attn_select.self_check(backend, cpu, torch.float32, PROBED_LAYERS["sinks"], 4)


class _BrokenDecode(PlainBackend):
    name = "broken_decode"

    def attend(self, q, k, v, k_cache, v_cache, meta, scale, softcap=None, sinks=None):
        out = super().attend(q, k, v, k_cache, v_cache, meta, scale)
        decode = meta[1]
        if decode is not None:
            out[decode.start : decode.end] *= 1.01
        return out


class _BrokenPrefill(PlainBackend):
    name = "broken_prefill"

    def attend(self, q, k, v, k_cache, v_cache, meta, scale, softcap=None, sinks=None):
        out = super().attend(q, k, v, k_cache, v_cache, meta, scale)
        for seg in meta[0]:
            out[seg.q_start : seg.q_end] *= 1.01
        return out


def test_a_rejected_backend_names_the_part_that_failed():
    args = (torch.device("cpu"), torch.float32, dense(4, 2, 16), 8)
    assert attn_select.self_check(_BrokenDecode(), *args).startswith("decode path: max abs error")
    assert attn_select.self_check(_BrokenPrefill(), *args).startswith("prefill kernel: max abs error")


def test_on_cuda_in_bf16_no_fused_backend_is_an_error_unless_plain_is_forced(monkeypatch):
    """The plain fallback is a per-sequence loop: on a GPU in bf16 it must never be chosen silently."""
    reasons = {
        "varlen_paged": "prefill kernel: RuntimeError: block size",
        "flash_varlen": "decode path: max abs error 0.5",
    }
    monkeypatch.setattr(attn_select, "cuda_candidates", lambda: list(reasons))
    monkeypatch.setattr(attn_select, "self_check", lambda backend, *a: reasons.get(backend.name, None))
    cuda = torch.device("cuda")
    with pytest.raises(RuntimeError, match="BULKGEN_ATTENTION=plain") as err:
        attn_select.select_backend(cuda, torch.bfloat16, [dense(8, 2, 64)], 16)
    assert all(reason in str(err.value) for reason in reasons.values())
    fp32 = attn_select.select_backend(cuda, torch.float32, [dense(8, 2, 64)], 16)  # flash has no fp32: plain
    assert fp32.name == "plain" and fp32.probe_report["varlen_paged"] == reasons["varlen_paged"]
    assert fp32.probe_report["flash_varlen+padded_decode"] == reasons["flash_varlen"]
    monkeypatch.setenv("BULKGEN_ATTENTION", "plain")
    forced = attn_select.select_backend(cuda, torch.bfloat16, [dense(8, 2, 64)], 16)
    assert forced.name == "plain" and "forced" in forced.probe_report["plain"]


def test_kv_cache_on_a_big_gpu_is_capped_at_what_the_batch_can_use(monkeypatch):
    """A tiny model on a 139 GiB GPU must not build ~30 M blocks (one Python object each); the budget
    counts memory torch holds unused (an earlier engine's freed cache) as free."""
    from bulkgen.engine.config import EngineConfig
    from bulkgen.engine.model_runner import kv_cache_blocks

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (137 * gib, 139 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    cuda = torch.device("cuda")
    cfg = EngineConfig(max_num_seqs=512, block_size=16)
    tiny = kv_cache_blocks(cfg, cuda, block_bytes=2 * 2 * 16 * 2 * 16 * 4, blocks_per_seq=2048 // 16)
    assert tiny == 512 * 128 * 5 // 4  # every slot at full context, plus a quarter for cached prefixes
    anchor_block = 2 * 16 * 16 * 8 * 64 * 2  # Llama-3.2-1B shape, bf16: 512 KiB a block
    anchor = kv_cache_blocks(cfg, cuda, block_bytes=anchor_block, blocks_per_seq=131072 // 16)
    assert anchor == int(137 * gib * 0.85) // anchor_block  # memory-bound: ~239k blocks
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 139 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)
    reused = kv_cache_blocks(cfg, cuda, block_bytes=anchor_block, blocks_per_seq=131072 // 16)
    assert reused == int(30 * gib * 0.85) // anchor_block
    assert kv_cache_blocks(EngineConfig(num_kv_blocks=77), cuda, anchor_block, 131072 // 16) == 77


def test_sdpa_kernel_order_is_pinned_inside_the_engine_and_the_choice_recorded(
    make_engine, reference, mixed_prompts
):
    """cuDNN attention builds a plan per new shape: inside the engine's forward SDPA may not pick it, the
    caller's settings come back afterwards, and the kernel each call site ran is recorded."""
    from bulkgen.engine.attention.attn_backends import SDPA_CHOICES
    from bulkgen.engine.attention.interface import attention_scope

    engine = make_engine("llama", block_size=4, max_num_batched_tokens=16)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with attention_scope(engine.model):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    SDPA_CHOICES.clear()
    prompts = mixed_prompts(seed=52, count=3, low=6, high=30)  # 16-token chunks: continuations too
    outs = engine.generate(prompts, _greedy(3))
    assert [o.token_ids for o in outs] == [reference.greedy("llama", p, 3) for p in prompts]
    assert set(SDPA_CHOICES) >= {"prefill, cpu float32", "prefill continuation, cpu float32"}
    assert SDPA_CHOICES["padded decode, cpu float32"] in {"flash_attention", "math"}
    assert all(choice in {"flash_attention", "math"} for choice in SDPA_CHOICES.values()), SDPA_CHOICES
