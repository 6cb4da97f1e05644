"""Packed, paged attention plugged into transformers through `AttentionInterface`.

The model sees one flat row of T tokens (batch dimension 1). Each layer writes its new K/V into the
paged cache (per layer [num_blocks, kv_heads, block_size, head_dim]) and every sequence attends only
to its own tokens. Metadata is built once per step by the model runner and arrives here in the
`bulkgen_ctx` forward kwarg, so nothing per-layer is rebuilt and transformers builds no [T, T] mask
(its mask factory early-exits for implementations it does not know).

Prefill chunks: scaled-dot-product attention per sequence (causal; with an explicit mask when the
chunk follows cached context). Decode tokens: all at once, block by block straight from the paged
cache (a batched matmul per block, then a softmax across each sequence's blocks): no per-sequence
loop and no padding beyond the unused tail of each sequence's last block. The same torch ops run on
CUDA (untested here: no GPU in development); a fused varlen/flex kernel there is future work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "bulkgen_paged"


@dataclass
class PrefillSegment:
    """Query rows [q_start, q_end) of one sequence; `blocks` is None when the chunk has no earlier context."""

    q_start: int
    q_end: int
    blocks: torch.Tensor | None = None  # block ids covering [0, context_len)
    context_len: int = 0
    mask: torch.Tensor | None = None  # [q, context_len] bool, with `blocks`


@dataclass
class DecodeBatch:
    """Single-token queries in rows [start, end), one per sequence, attending over their blocks."""

    start: int
    end: int
    blocks: torch.Tensor  # [NB] every decode sequence's blocks, concatenated
    owner: torch.Tensor  # [NB] index (0..end-start-1) of the sequence owning each block
    pad: torch.Tensor  # [NB, block_size] True at unused slots of each sequence's last block


@dataclass
class StepContext:
    """Per-step attention metadata, shared by every layer of one forward pass."""

    write_rows: torch.Tensor  # [T * Hkv] rows of the cache viewed as [-1, head_dim] for the new K/V
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    prefills: list[PrefillSegment] = field(default_factory=list)
    decode: DecodeBatch | None = None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    bulkgen_ctx: StepContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> output [1, T, Hq, D]."""
    if bulkgen_ctx is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} got no step context: it only runs inside "
            f"bulkgen.engine, on models whose layers pass forward kwargs down to attention"
        )
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("bulkgen's paged attention has no logit soft-capping or attention sinks")
    ctx = bulkgen_ctx
    k_cache, v_cache = ctx.k_caches[module.layer_idx], ctx.v_caches[module.layer_idx]
    dim = key.shape[-1]
    k_cache.view(-1, dim).index_copy_(0, ctx.write_rows, key[0].transpose(0, 1).reshape(-1, dim))
    v_cache.view(-1, dim).index_copy_(0, ctx.write_rows, value[0].transpose(0, 1).reshape(-1, dim))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0]  # [Hq, T, D]
    out = query.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, Hq, D]
    for seg in ctx.prefills:
        out[seg.q_start : seg.q_end] = _prefill(q, key[0], value[0], k_cache, v_cache, seg, scale)
    if ctx.decode is not None:
        dec = ctx.decode
        out[dec.start : dec.end] = _decode(q[:, dec.start : dec.end].transpose(0, 1), k_cache, v_cache, dec, scale)
    return out.unsqueeze(0), None


def _prefill(q, key, value, k_cache, v_cache, seg: PrefillSegment, scale: float) -> torch.Tensor:
    qs = q[:, seg.q_start : seg.q_end]  # [Hq, L, D]
    if seg.blocks is None:
        ks, vs = key[:, seg.q_start : seg.q_end], value[:, seg.q_start : seg.q_end]
    else:
        ks, vs = _contiguous(k_cache, seg), _contiguous(v_cache, seg)
    out = F.scaled_dot_product_attention(  # 4-D inputs reach the fused CPU kernel; 3-D ones do not
        qs[None], ks[None], vs[None], attn_mask=seg.mask, is_causal=seg.mask is None and qs.shape[1] > 1,
        scale=scale, enable_gqa=ks.shape[0] != qs.shape[0],
    )
    return out[0].transpose(0, 1)


def _contiguous(cache: torch.Tensor, seg: PrefillSegment) -> torch.Tensor:
    """[Hkv, context_len, D] for one sequence, gathered from its blocks."""
    blocks = cache.index_select(0, seg.blocks)  # [nb, Hkv, bs, D]
    hkv, dim = blocks.shape[1], blocks.shape[3]
    return blocks.transpose(0, 1).reshape(hkv, -1, dim)[:, : seg.context_len]


def _decode(q: torch.Tensor, k_cache, v_cache, dec: DecodeBatch, scale: float) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]: per-block scores, softmax across each sequence's blocks."""
    num_seqs, hq, dim = q.shape
    kb, vb = k_cache.index_select(0, dec.blocks), v_cache.index_select(0, dec.blocks)  # [NB, Hkv, bs, D]
    hkv = kb.shape[1]
    qb = q.reshape(num_seqs, hkv, hq // hkv, dim).index_select(0, dec.owner)  # [NB, Hkv, G, D]
    scores = torch.matmul(qb, kb.transpose(-1, -2)).float().mul_(scale)  # [NB, Hkv, G, bs], fp32 softmax
    scores.masked_fill_(dec.pad[:, None, None, :], float("-inf"))
    block_max = scores.amax(dim=-1)  # [NB, Hkv, G]
    seq_max = block_max.new_full((num_seqs, *block_max.shape[1:]), float("-inf"))
    seq_max.scatter_reduce_(0, dec.owner.view(-1, 1, 1).expand_as(block_max), block_max, "amax")
    weights = torch.exp(scores - seq_max.index_select(0, dec.owner).unsqueeze(-1))
    denom = seq_max.new_zeros(seq_max.shape).index_add_(0, dec.owner, weights.sum(dim=-1))
    partial = torch.matmul(weights.to(vb.dtype), vb).float()  # [NB, Hkv, G, D]
    out = partial.new_zeros((num_seqs, *partial.shape[1:])).index_add_(0, dec.owner, partial)
    return (out / denom.unsqueeze(-1)).view(num_seqs, hq, dim).to(q.dtype)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
