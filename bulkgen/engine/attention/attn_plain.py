"""The plain attention backend: prefill chunks by per-sequence SDPA, decodes all at once from the cache.

It is the CPU path, the float32 reference every fused kernel is checked against (attn_select), and the
fallback for what no fused kernel in this torch takes (logit soft-capping). A continuation chunk, or
any chunk of a sliding-window or chunked layer, gathers its keys from the cache, from the first
position its first query reads, and gets an explicit mask (each query reads from `first_visible` of
its own position). A chunk reaching an image block whose tokens read each other both ways gets a mask
too (Gemma 3: each of the block's queries also reads the block's later keys, image_blocks.py).
Soft-capped or sink layers go through `eager_attention` (scores in float32, transformers' eager order:
scale, soft-cap, mask, sinks as one more softmax column), as SDPA takes neither.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bulkgen.engine.attention import triton_decode
from bulkgen.engine.attention.layer_attention import FULL, AttnKind
from bulkgen.engine.kv import kv_cache
from bulkgen.engine.step_plan import HostPack, StepPlan

log = logging.getLogger(__name__)
# "call site, device dtype" ("prefill, cuda bfloat16"; sites: prefill, prefill continuation, padded
# decode) -> the SDPA kernel its first call got,
# under the order attention.attention_scope pins; benchmarks record it beside their timings
SDPA_CHOICES: dict[str, str] = {}


@dataclass
class Segment:
    """Query rows [q_start, q_end) of one prefill chunk, at positions from `start`; its keys are this
    step's own rows unless `rows` (cache rows of positions [key_start, end)); `mask` [q, keys] unless
    plain causal over its own rows."""

    q_start: int
    q_end: int
    start: int = 0
    key_start: int = 0
    kind: AttnKind = FULL
    rows: torch.Tensor | slice | None = None
    mask: torch.Tensor | None = None
    blocks: list[tuple[int, int]] | None = None  # image blocks read bidirectionally (image_blocks.py)


@dataclass
class DecodeMeta:
    """Single-token queries in rows [start, end), one per sequence, over its blocks in the cache."""

    start: int
    end: int
    table: torch.Tensor | slice | None  # [B, max_blocks] block ids, padded (masked out by length)
    lengths: torch.Tensor | slice  # [B] context length including the new token
    # or the table as `width` columns of rows `rows` of a persistent device table `source` (StepPlan)
    rows: slice | None = None
    source: torch.Tensor | None = None
    width: int = 0
    kind: AttnKind = FULL  # the keys each query reads: from kind.first_visible(length - 1)

    def bind(self, flat: torch.Tensor) -> DecodeMeta:
        if self.rows is not None:
            self.table = self.source.index_select(0, flat[self.rows])[:, : self.width]
        else:
            self.table = flat[self.table].view(self.end - self.start, -1)
        self.lengths = flat[self.lengths]
        return self


class PlainBackend:
    name = "plain"
    device_decode_tables = True  # its decodes may read their tables from StepPlan.decode_table

    def __init__(self, decode_kernel: str | None = None) -> None:
        """`decode_kernel`: "padded" or "triton" for the decode rows; None: the device's default
        (triton on CUDA where it imports, see triton_decode.default_kernel)."""
        self.decode_kernel = decode_kernel

    def supports(self, layer) -> str | None:
        """Why this backend cannot run `layer` (a LayerAttention), or None: plain runs every layer."""
        return None

    def prepare(self, plan: StepPlan, pack: HostPack, kind: AttnKind = FULL):
        segments, q_off = [], 0
        for i in range(plan.num_prefill):
            start, n = plan.starts[i], plan.counts[i]
            seg = Segment(q_off, q_off + n, start, 0, kind)
            if plan.image_blocks:
                seg.blocks = plan.image_blocks[i] or None
            if start > 0:
                seg.key_start = kind.first_visible(start)
                seg.rows = pack.add(
                    _context_rows(plan.block_tables[i], seg.key_start, start + n, plan.block_size)
                )
            segments.append(seg)
            q_off += n
        return segments, decode_meta(plan, pack, q_off, kind)

    def bind(self, meta, flat: torch.Tensor):
        segments, decode = meta
        for seg in segments:
            if seg.rows is not None:
                seg.rows = flat[seg.rows]
            if seg.rows is not None or not seg.kind.is_full or seg.blocks:
                count = seg.q_end - seg.q_start
                seg.mask = visible(seg.kind, seg.start, count, seg.key_start, flat.device, seg.blocks)
        return segments, decode.bind(flat) if decode is not None else None

    def attend(self, q, k, v, k_cache, v_cache, meta, scale: float, softcap=None, sinks=None) -> torch.Tensor:
        """q [T, Hq, Dk], k/v [T, Hkv, Dk/Dv] (this step's tokens) -> [T, Hq, Dv]. `softcap`: a float or
        None; `sinks`: [Hq] logits or None."""
        segments, decode = meta
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        for seg in segments:
            out[seg.q_start : seg.q_end] = _segment(q, k, v, k_cache, v_cache, seg, scale, softcap, sinks)
        if decode is not None:
            out[decode.start : decode.end] = paged_decode(
                q[decode.start : decode.end],
                k_cache,
                v_cache,
                decode,
                scale,
                self.decode_kernel,
                softcap,
                sinks,
            )
        return out


def visible(kind: AttnKind, start: int, count: int, key_start: int, device, blocks=None) -> torch.Tensor:
    """[count, keys] bool: which keys (positions key_start .. start + count - 1) each query (positions
    start .. start + count - 1) reads. `blocks`: [lo, hi) image blocks whose queries also read the later
    keys of their own block (Gemma 3; image_blocks.py: the chunk holds the rest of every block it reaches)."""
    q_pos = torch.arange(start, start + count, device=device)[:, None]
    k_pos = torch.arange(key_start, start + count, device=device)[None, :]
    mask = (k_pos <= q_pos) & (k_pos >= kind.first_visible_t(q_pos))
    for lo, hi in blocks or ():
        q_in, k_in = (q_pos >= lo) & (q_pos < hi), (k_pos >= lo) & (k_pos < hi)
        mask |= q_in & k_in & (k_pos > q_pos)
    return mask


def _context_rows(table: list[int], first: int, end: int, bs: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in range(first, end)]


def decode_meta(plan: StepPlan, pack: HostPack, q_off: int, kind: AttnKind = FULL) -> DecodeMeta | None:
    if not plan.num_decode:
        return None
    rows = range(plan.num_prefill, len(plan.starts))
    lengths = [plan.starts[i] + 1 for i in rows]
    width = -(-max(lengths) // plan.block_size)
    end = q_off + plan.num_decode
    if plan.decode_rows is not None:  # the tables are on the device already: rows and lengths only
        return DecodeMeta(
            q_off, end, None, pack.add(lengths), plan.decode_rows, plan.decode_table, width, kind
        )
    table = [
        b
        for i, n in zip(rows, lengths, strict=True)
        for b in plan.block_tables[i][: -(-n // plan.block_size)] + [0] * (width - -(-n // plan.block_size))
    ]
    return DecodeMeta(q_off, end, pack.add(table), pack.add(lengths), kind=kind)


def _segment(q, k, v, k_cache, v_cache, seg: Segment, scale: float, softcap, sinks) -> torch.Tensor:
    qs = q[seg.q_start : seg.q_end].transpose(0, 1)  # [Hq, L, D]
    if seg.rows is None:
        ks, vs = k[seg.q_start : seg.q_end], v[seg.q_start : seg.q_end]
    else:
        ks = kv_cache.read_rows(k_cache, seg.rows, q.dtype)
        vs = kv_cache.read_rows(v_cache, seg.rows, q.dtype)
    ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)  # [Hkv, S, D]
    if softcap is not None or sinks is not None:
        mask = seg.mask if seg.mask is not None else visible(FULL, 0, qs.shape[1], 0, q.device)
        return eager_attention(qs[None], ks[None], vs[None], mask, scale, softcap, sinks)[0].transpose(0, 1)
    site = "prefill" if seg.mask is None else "prefill continuation"
    out = sdpa(  # 4-D inputs reach the fused CPU kernel; 3-D ones do not
        site,
        qs[None],
        ks[None],
        vs[None],
        attn_mask=seg.mask,
        is_causal=seg.mask is None and qs.shape[1] > 1,
        scale=scale,
        enable_gqa=ks.shape[0] != qs.shape[0],
    )
    return out[0].transpose(0, 1)


def eager_attention(q, k, v, mask, scale: float, softcap=None, sinks=None) -> torch.Tensor:
    """q [B, Hq, L, Dk], k/v [B, Hkv, S, Dk/Dv], mask bool broadcastable to [B, L, S] -> [B, Hq, L, Dv] in
    q's dtype, with scores and softmax in float32; sinks [Hq] join each softmax as a column whose value
    is zero (they take probability mass and return nothing)."""
    b, hq, length, dim = q.shape
    hkv, keys = k.shape[1], k.shape[2]
    grouped = q.float().view(b, hkv, hq // hkv, length, dim)  # query heads sharing a KV head
    scores = torch.einsum("bhgld,bhsd->bhgls", grouped, k.float()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask.view(-1, 1, 1, length, keys), float("-inf"))
    if sinks is not None:
        column = sinks.float().view(1, hkv, hq // hkv, 1, 1).expand(b, -1, -1, length, 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = scores.softmax(dim=-1)[..., :keys]
    out = torch.einsum("bhgls,bhsv->bhglv", probs, v.float())
    return out.reshape(b, hq, length, v.shape[-1]).to(q.dtype)


def paged_decode(
    q: torch.Tensor, k_cache, v_cache, dec: DecodeMeta, scale: float, kernel=None, softcap=None, sinks=None
) -> torch.Tensor:
    """q [B, Hq, Dk] -> [B, Hq, Dv]. With the triton kernel (CUDA's default) each sequence reads its own
    blocks in place, from the first its window or chunk reads. The padded path gathers each sequence's
    blocks into a padded [B, Hkv, L, D] and makes one masked SDPA call: it copies the decode sequences'
    KV per layer (the CPU path, the reference every other kernel is checked against, and CUDA's fallback
    without triton). Scores stay float32 either way (bf16 scores before the softmax cost 5x the error)."""
    kind = dec.kind
    if (kernel or triton_decode.default_kernel(q.device)) == "triton":
        return triton_decode.paged_decode(
            q, k_cache, v_cache, dec.table, dec.lengths, scale, kind.window, kind.chunk, softcap, sinks
        )
    num_seqs, hq, dim = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    compute = torch.float32 if q.device.type == "cpu" else q.dtype
    k = kv_cache.read_blocks(k_cache, dec.table, compute).view(num_seqs, -1, hkv, dim).transpose(1, 2)
    v = kv_cache.read_blocks(v_cache, dec.table, compute).view(num_seqs, -1, hkv, dv).transpose(1, 2)
    pos = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = (pos < dec.lengths[:, None]) & (pos >= kind.first_visible_t(dec.lengths - 1)[:, None])  # [B, L]
    if softcap is not None or sinks is not None:
        out = eager_attention(q.to(compute)[:, :, None], k, v, mask[:, None, :], scale, softcap, sinks)
        return out[:, :, 0].to(q.dtype)
    # The query heads sharing a KV head become that head's query rows: no GQA expansion, and the
    # masked bf16 case stays eligible for the memory-efficient kernel (which lacks enable_gqa).
    grouped = q.to(compute).view(num_seqs, hkv, hq // hkv, dim)
    out = sdpa("padded decode", grouped, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, hq, dv).to(q.dtype)


def sdpa(site: str, q, k, v, **kwargs) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, logging once per call site which kernel SDPA chose for it."""
    key = f"{site}, {q.device.type} {str(q.dtype).removeprefix('torch.')}"
    if key not in SDPA_CHOICES:
        SDPA_CHOICES[key] = sdpa_choice(q, k, v, **kwargs)
        log.info("attention: SDPA runs %s with the %s kernel", key, SDPA_CHOICES[key])
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def sdpa_choice(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False) -> str:
    """The kernel SDPA picks for these inputs under the current backend settings (`torch._fused_sdp_choice`
    is private: if it goes away or refuses the call, the answer says so instead of failing the step)."""
    try:
        choice = torch._fused_sdp_choice(
            q, k, v, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        return f"unknown ({type(exc).__name__})"
    names = {int(b): name.lower() for name, b in torch.nn.attention.SDPBackend.__members__.items()}
    return names.get(int(choice), str(int(choice)))
