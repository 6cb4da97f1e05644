"""Paged decode attention in Triton: each sequence's one query reads its K/V blocks in place.

The padded path (`attn_backends.paged_decode`) gathers every decode sequence's blocks into a tensor
padded to the widest table of the step and runs a masked SDPA over it: three passes over up to three
times the real KV bytes. This kernel reads each real K/V row once, straight from the paged cache
through the block table, and never touches padding: a program per (sequence, KV head, split) walks its
share of the sequence's blocks with an online softmax for all the query heads that share that KV head
(GQA without expanding K/V), and a short torch reduction merges the splits (flash-decoding). Splits
give a small batch enough programs to fill the GPU; their number depends only on the shapes, so the
launch is the same on every replay of a CUDA graph. Blocks are dealt to the splits in turn (split s
takes blocks s, s + splits, ... after the first one the query reads): the table is as wide as the
longest context the engine allows (8,192 columns in the decode graphs), so contiguous shares of it would
leave every real block in split 0. Each loop iteration reads a tile of whole blocks (`_TILE_TOKENS` rows:
one 16-row block by default, as measured so far; bench/gpu_decode_tiles.py times larger tiles, warps and
splits against it on a GPU), and tiles are dealt to the splits the same way. Scores and the softmax run
in float32.

Used on CUDA when triton imports (the engine probes it against the padded path at startup like any
attention kernel); `BULKGEN_DECODE_KERNEL=padded|triton` forces one. On CPU the tests run it under
`TRITON_INTERPRET=1` against the padded reference.

A layer's attention arrives as parameters: a sliding window or an attention chunk moves the first
block each sequence reads (the splits' dealing starts there) to the block of `lo`, the first position its query reads (blocks wholly before
it are never loaded, so a windowed group's freed blocks may hold anything), and rows before `lo` are
masked; a soft-cap bends every score (softcap * tanh(score / softcap)) before the online softmax; sinks
are one more logit per head, added to the denominator when the splits are merged (`_merge`). V heads may
be narrower than K heads (MLA).
"""

from __future__ import annotations

import os

import torch

from bulkgen.engine.kv.kv_cache import Fp8Cache

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels have no triton: the padded path serves
    triton = None

KERNELS = ("padded", "triton")
_TARGET_PROGRAMS = 264  # about two programs per SM of an H100/H200 (132 SMs)
_MAX_SPLITS = 16
# K/V rows one loop iteration reads (whole blocks: tile_blocks(block_size)); more rows per iteration keep
# more loads in flight. bench/gpu_decode_tiles.py measures each choice against one block per iteration.
_TILE_TOKENS = 16
_NUM_WARPS = 4


def tile_blocks(block_size: int, tile_tokens: int | None = None) -> int:
    """Blocks per loop iteration: as many as fit `tile_tokens` rows (at least one)."""
    return max(1, (tile_tokens or _TILE_TOKENS) // block_size)


def available() -> bool:
    return triton is not None


def default_kernel(device: torch.device) -> str:
    forced = os.environ.get("BULKGEN_DECODE_KERNEL")
    if forced:
        if forced not in KERNELS:
            raise ValueError(f"BULKGEN_DECODE_KERNEL={forced!r}: choose one of {KERNELS}")
        if forced == "triton" and not available():
            raise ValueError("BULKGEN_DECODE_KERNEL=triton but triton is not installed")
        return forced
    return "triton" if device.type == "cuda" and available() else "padded"


def num_splits(batch: int, kv_heads: int, width: int, target: int | None = None) -> int:
    """Splits of each sequence's blocks: enough programs for the GPU, never more than blocks."""
    programs = target or _TARGET_PROGRAMS
    return max(1, min(width, _MAX_SPLITS, -(-programs // max(1, batch * kv_heads))))


_NONE = 1 << 30  # a window or chunk no sequence reaches: every position readable


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    tuning: dict | None = None,
) -> torch.Tensor:
    """q [B, Hq, Dk]; caches [blocks, block_size, Hkv, Dk or Dv]; table [B, W] block ids (padding
    unread); lengths [B] context lengths including the new token -> [B, Hq, Dv] in q's dtype. `window`:
    the query reads itself and the window - 1 positions before; `chunk`: only its own chunk; `softcap`:
    scores soft-capped; `sinks` [Hq]: each head's sink logit. `tuning` (benchmarks): `tile_tokens`,
    `num_warps`, `target_programs` in place of the module's defaults."""
    tuning = tuning or {}
    splits = num_splits(q.shape[0], k_cache.shape[2], table.shape[1], tuning.get("target_programs"))
    acc, stats = _launch(
        q,
        k_cache,
        v_cache,
        table,
        lengths,
        scale,
        splits,
        window,
        chunk,
        softcap,
        tile_blocks(k_cache.shape[1], tuning.get("tile_tokens")),
        tuning.get("num_warps") or _NUM_WARPS,
    )
    return _merge(acc, stats[0], stats[1], sinks).to(q.dtype)


def _launch(
    q,
    k_cache,
    v_cache,
    table,
    lengths,
    scale: float,
    splits: int,
    window=None,
    chunk=None,
    softcap=None,
    tile: int = 1,
    num_warps: int = _NUM_WARPS,
):
    """Run the split kernel: per-split partial results acc [B, Hq, splits, Dv] and stats [2, B, Hq, splits]
    (running max, running sum; a split that held no block keeps -inf and 0). Over 50 lines because the one
    launch passes every stride and constexpr of the kernel's signature; each is one line."""
    batch, hq, dim = q.shape
    block_size, hkv, dim_v = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    fp8 = isinstance(k_cache, Fp8Cache)
    # an FP8 cache's rows and their scales (kv_cache); a float cache passes its rows as dummy scales
    k_scale, v_scale = (k_cache.scale, v_cache.scale) if fp8 else (k_cache, v_cache)
    if fp8:
        k_cache, v_cache = k_cache.data, v_cache.data
    group = hq // hkv
    # the interpreter cannot loop to a tensor bound: each split walks a fixed count of its blocks, enough
    # for the longest sequence (a host read; the compiled kernel reads each sequence's own length)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    longest = -(-int(lengths.max()) // block_size) if interpreted else 0  # in blocks
    acc = torch.empty(batch, hq, splits, dim_v, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, batch, hq, splits, dtype=torch.float32, device=q.device)  # running max, sum
    _decode_split[(batch, hkv, splits)](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        table,
        lengths,
        acc,
        stats,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        k_scale.stride(0),
        k_scale.stride(1),
        k_scale.stride(2),
        table.stride(0),
        acc.stride(0),
        acc.stride(1),
        acc.stride(2),
        stats.stride(0),
        stats.stride(1),
        stats.stride(2),
        scale,
        splits,
        window or _NONE,
        chunk or _NONE,
        softcap or 1.0,
        GROUP=group,
        GROUP_P=triton.next_power_of_2(group),
        DIM=dim,
        DIM_P=triton.next_power_of_2(dim),
        DIM_V=dim_v,
        DIM_V_P=triton.next_power_of_2(dim_v),
        BLOCK_SIZE=block_size,
        SOFTCAP=softcap is not None,
        FP8=fp8,
        TILE_BLOCKS=tile,
        PER_SPLIT=max(1, -(-longest // (splits * tile))),
        DYNAMIC_LOOP=not interpreted,
        num_warps=num_warps,
    )
    return acc, stats


def _merge(acc: torch.Tensor, maxes: torch.Tensor, sums: torch.Tensor, sinks=None) -> torch.Tensor:
    """Combine the splits' partial softmaxes (and each head's sink logit, a denominator term with no
    value); a split with no block has max -inf and weight 0."""
    top = maxes.amax(dim=-1, keepdim=True)  # finite: split 0 always holds the first block read (lo's)
    if sinks is not None:
        top = torch.maximum(top, sinks.float()[None, :, None])
    weights = torch.exp(maxes - top)
    total = (sums * weights).sum(dim=-1)
    if sinks is not None:
        total = total + torch.exp(sinks.float()[None, :] - top[..., 0])
    return (acc * weights[..., None]).sum(dim=-2) / total[..., None]


if triton is not None:

    @triton.jit
    def _attend_tile(
        q,
        running_max,
        running_sum,
        acc,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        table_ptr,
        seq,
        kv_head,
        block,
        lo,
        length,
        sk_blk,
        sk_tok,
        sk_h,
        sv_blk,
        sv_tok,
        sv_h,
        sc_blk,
        sc_tok,
        sc_h,
        st_b,
        softcap,
        DIM: tl.constexpr,
        DIM_P: tl.constexpr,
        DIM_V: tl.constexpr,
        DIM_V_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SOFTCAP: tl.constexpr,
        FP8: tl.constexpr,
        TILE_BLOCKS: tl.constexpr,
    ):
        """TILE_BLOCKS K/V blocks from `block` on into the online softmax of the group's query heads; rows before `lo` (outside
        the window or chunk) or past the sequence count for nothing. A block past the sequence (the
        interpreter's fixed-count loop) loads nothing and leaves the state as it was. Its length is its signature: a jitted helper takes every pointer, stride
        and constexpr as its own argument."""
        d, e = tl.arange(0, DIM_P), tl.arange(0, DIM_V_P)
        row = tl.arange(0, TILE_BLOCKS * BLOCK_SIZE)
        blocks = block + row // BLOCK_SIZE  # each row's block
        t = row % BLOCK_SIZE  # its row inside the block
        pos = blocks * BLOCK_SIZE + t
        valid = (pos < length) & (pos >= lo)
        physical = tl.load(table_ptr + seq * st_b + blocks, mask=blocks * BLOCK_SIZE < length, other=0).to(
            tl.int64
        )
        k_rows = physical[:, None] * sk_blk + t[:, None] * sk_tok + kv_head * sk_h + d[None, :]
        k = tl.load(k_ptr + k_rows, mask=valid[:, None] & (d[None, :] < DIM), other=0.0).to(tl.float32)
        if FP8:  # each row times its own scale (kv_cache.Fp8Cache)
            scale_rows = physical * sc_blk + t * sc_tok + kv_head * sc_h
            k = k * tl.load(ks_ptr + scale_rows, mask=valid, other=0.0)[:, None]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_P, TILE_BLOCKS * BLOCK_SIZE]
        if SOFTCAP:  # softcap * tanh(scores / softcap), tanh from exp (saturates to +-1, never NaN)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing seen yet: exp(-inf) = 0
        p = tl.exp(scores - safe_max[:, None])
        alpha = tl.exp(running_max - safe_max)
        v_rows = physical[:, None] * sv_blk + t[:, None] * sv_tok + kv_head * sv_h + e[None, :]
        v = tl.load(v_ptr + v_rows, mask=valid[:, None] & (e[None, :] < DIM_V), other=0.0).to(tl.float32)
        if FP8:
            v = v * tl.load(vs_ptr + scale_rows, mask=valid, other=0.0)[:, None]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        return new_max, running_sum * alpha + tl.sum(p, axis=1), acc

    @triton.jit
    def _decode_split(
        q_ptr,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        table_ptr,
        lengths_ptr,
        acc_ptr,
        stats_ptr,
        sq_b,
        sq_h,
        sk_blk,
        sk_tok,
        sk_h,
        sv_blk,
        sv_tok,
        sv_h,
        sc_blk,
        sc_tok,
        sc_h,
        st_b,
        sa_b,
        sa_h,
        sa_s,
        ss_kind,
        ss_b,
        ss_h,
        scale,
        splits,
        window,
        chunk,
        softcap,
        GROUP: tl.constexpr,
        GROUP_P: tl.constexpr,
        DIM: tl.constexpr,
        DIM_P: tl.constexpr,
        DIM_V: tl.constexpr,
        DIM_V_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        SOFTCAP: tl.constexpr,
        FP8: tl.constexpr,
        TILE_BLOCKS: tl.constexpr,
        PER_SPLIT: tl.constexpr,
        DYNAMIC_LOOP: tl.constexpr,
    ):
        """One program: one sequence, one KV head (its query group), one split of its blocks. Over 50 lines
        because a Triton kernel is one compiled body whose signature lists every pointer, stride and
        constexpr; the loop's body lives in `_attend_tile`."""
        seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(lengths_ptr + seq)
        # the first position the query (at length - 1) reads: its window's or its chunk's first
        lo = tl.maximum(length - window, 0)
        lo = tl.maximum(lo, (length - 1) // chunk * chunk)
        # the blocks from lo's on, in tiles of TILE_BLOCKS dealt to the splits in turn
        first = lo // BLOCK_SIZE + split * TILE_BLOCKS
        stride = splits * TILE_BLOCKS
        g, d, e = tl.arange(0, GROUP_P), tl.arange(0, DIM_P), tl.arange(0, DIM_V_P)
        heads = kv_head * GROUP + g
        q_mask = (g[:, None] < GROUP) & (d[None, :] < DIM)
        q = tl.load(q_ptr + seq * sq_b + heads[:, None] * sq_h + d[None, :], mask=q_mask, other=0.0)
        q = q.to(tl.float32) * scale
        running_max = tl.full([GROUP_P], float("-inf"), tl.float32)
        running_sum = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, DIM_V_P], tl.float32)
        if DYNAMIC_LOOP:  # compiled: only the sequence's own blocks, every splits-th from this split's
            for block in range(first, tl.cdiv(length, BLOCK_SIZE), stride):
                running_max, running_sum, acc = _attend_tile(
                    q,
                    running_max,
                    running_sum,
                    acc,
                    k_ptr,
                    v_ptr,
                    ks_ptr,
                    vs_ptr,
                    table_ptr,
                    seq,
                    kv_head,
                    block,
                    lo,
                    length,
                    sk_blk,
                    sk_tok,
                    sk_h,
                    sv_blk,
                    sv_tok,
                    sv_h,
                    sc_blk,
                    sc_tok,
                    sc_h,
                    st_b,
                    softcap,
                    DIM,
                    DIM_P,
                    DIM_V,
                    DIM_V_P,
                    BLOCK_SIZE,
                    SOFTCAP,
                    FP8,
                    TILE_BLOCKS,
                )
        else:  # the CPU interpreter cannot loop to a tensor bound: a fixed count, blocks past the end masked
            for i in range(PER_SPLIT):
                running_max, running_sum, acc = _attend_tile(
                    q,
                    running_max,
                    running_sum,
                    acc,
                    k_ptr,
                    v_ptr,
                    ks_ptr,
                    vs_ptr,
                    table_ptr,
                    seq,
                    kv_head,
                    first + i * stride,
                    lo,
                    length,
                    sk_blk,
                    sk_tok,
                    sk_h,
                    sv_blk,
                    sv_tok,
                    sv_h,
                    sc_blk,
                    sc_tok,
                    sc_h,
                    st_b,
                    softcap,
                    DIM,
                    DIM_P,
                    DIM_V,
                    DIM_V_P,
                    BLOCK_SIZE,
                    SOFTCAP,
                    FP8,
                    TILE_BLOCKS,
                )
        head_mask = g < GROUP
        base = seq * sa_b + heads * sa_h + split * sa_s
        tl.store(acc_ptr + base[:, None] + e[None, :], acc, mask=(g[:, None] < GROUP) & (e[None, :] < DIM_V))
        stat = seq * ss_b + heads * ss_h + split
        tl.store(stats_ptr + stat, running_max, mask=head_mask)
        tl.store(stats_ptr + ss_kind + stat, running_sum, mask=head_mask)
