"""Attention backends over the packed row and the paged cache, chosen once per engine by probing.

- `plain` (CPU, and the fallback everywhere): prefill chunks by per-sequence SDPA (a continuation
  chunk gathers its context and uses an explicit causal mask); decodes all at once, block by block
  from the cache, with scores, softmax and the weighted sum in float32.
- `flash_varlen` (CUDA, `aten._flash_attention_forward`): every prefill chunk of the step in one
  varlen kernel with cumulative lengths (continuation chunks included: their context is gathered
  from the cache and flash's bottom-right causal alignment needs no mask); decodes as in `plain`.
- `varlen_paged` (CUDA, `torch.nn.attention.varlen.varlen_attn` with `block_table`, torch >= 2.13):
  the whole step, prefill and decode, in one kernel reading K/V straight from the paged cache.

Flash kernels accumulate scores in float32. `select_backend` tries the CUDA candidates that exist
in this torch, checks each against `plain` on a small packed case, and keeps the first that agrees;
`BULKGEN_ATTENTION=<name>` forces one.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import triton_decode
from .step_plan import HostPack, StepPlan

log = logging.getLogger(__name__)
# "call site, device dtype" ("prefill, cuda bfloat16"; sites: prefill, prefill continuation, padded
# decode) -> the SDPA kernel its first call got,
# under the order attention.attention_scope pins; benchmarks record it beside their timings
SDPA_CHOICES: dict[str, str] = {}


@dataclass
class Segment:
    """Query rows [q_start, q_end) of one prefill chunk; `rows`/`mask` only when it follows cached context."""

    q_start: int
    q_end: int
    rows: torch.Tensor | slice | None = None  # cache rows of its context [0, end)
    mask: torch.Tensor | None = None  # [q, end] bool


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

    def prepare(self, plan: StepPlan, pack: HostPack) -> tuple[list[Segment], DecodeMeta | None]:
        segments, q_off = [], 0
        for i in range(plan.num_prefill):
            start, n = plan.starts[i], plan.counts[i]
            seg = Segment(q_off, q_off + n)
            if start > 0:
                seg.rows = pack.add(_context_rows(plan.block_tables[i], start + n, plan.block_size))
            segments.append(seg)
            q_off += n
        return segments, _decode_meta(plan, pack, q_off)

    def bind(self, meta, flat: torch.Tensor):
        segments, decode = meta
        for seg in segments:
            if seg.rows is not None:
                seg.rows = flat[seg.rows]
                end, n = seg.rows.numel(), seg.q_end - seg.q_start
                q_pos = torch.arange(end - n, end, device=flat.device)
                seg.mask = torch.arange(end, device=flat.device)[None, :] <= q_pos[:, None]
        return segments, decode.bind(flat) if decode is not None else None

    def attend(self, q, k, v, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (this step's tokens) -> [T, Hq, D]."""
        segments, decode = meta
        out = torch.empty_like(q)
        for seg in segments:
            out[seg.q_start : seg.q_end] = _sdpa_segment(q, k, v, k_cache, v_cache, seg, scale)
        if decode is not None:
            out[decode.start : decode.end] = paged_decode(
                q[decode.start : decode.end], k_cache, v_cache, decode, scale, self.decode_kernel
            )
        return out


def _context_rows(table: list[int], end: int, bs: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in range(end)]


def _decode_meta(plan: StepPlan, pack: HostPack, q_off: int) -> DecodeMeta | None:
    if not plan.num_decode:
        return None
    rows = range(plan.num_prefill, len(plan.starts))
    lengths = [plan.starts[i] + 1 for i in rows]
    width = -(-max(lengths) // plan.block_size)
    if plan.decode_rows is not None:  # the tables are on the device already: rows and lengths only
        end = q_off + plan.num_decode
        return DecodeMeta(q_off, end, None, pack.add(lengths), plan.decode_rows, plan.decode_table, width)
    table = [
        b
        for i, n in zip(rows, lengths, strict=True)
        for b in plan.block_tables[i][: -(-n // plan.block_size)] + [0] * (width - -(-n // plan.block_size))
    ]
    return DecodeMeta(q_off, q_off + plan.num_decode, pack.add(table), pack.add(lengths))


def _sdpa_segment(q, k, v, k_cache, v_cache, seg: Segment, scale: float) -> torch.Tensor:
    qs = q[seg.q_start : seg.q_end].transpose(0, 1)  # [Hq, L, D]
    if seg.rows is None:
        ks, vs = k[seg.q_start : seg.q_end], v[seg.q_start : seg.q_end]
    else:
        ks = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, seg.rows)
        vs = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, seg.rows)
    ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)  # [Hkv, S, D]
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


def paged_decode(
    q: torch.Tensor, k_cache, v_cache, dec: DecodeMeta, scale: float, kernel: str | None = None
) -> torch.Tensor:
    """q [B, Hq, D] -> [B, Hq, D]. With the triton kernel (CUDA's default) each sequence reads its own
    blocks in place. The padded path gathers each sequence's blocks into a padded [B, Hkv, L, D] and
    makes one masked SDPA call: it copies the decode sequences' KV per layer (the CPU path, the
    reference every other kernel is checked against, and CUDA's fallback without triton). Scores stay
    float32 either way (bf16 scores before the softmax cost 5x the error)."""
    if (kernel or triton_decode.default_kernel(q.device)) == "triton":
        return triton_decode.paged_decode(q, k_cache, v_cache, dec.table, dec.lengths, scale)
    num_seqs, hq, dim = q.shape
    hkv = k_cache.shape[2]
    compute = torch.float32 if q.device.type == "cpu" else q.dtype
    k = k_cache[dec.table].view(num_seqs, -1, hkv, dim).transpose(1, 2).to(compute)  # [B, Hkv, L, D]
    v = v_cache[dec.table].view(num_seqs, -1, hkv, dim).transpose(1, 2).to(compute)
    mask = torch.arange(k.shape[2], device=q.device)[None, :] < dec.lengths[:, None]  # [B, L]
    # The query heads sharing a KV head become that head's query rows: no GQA expansion, and the
    # masked bf16 case stays eligible for the memory-efficient kernel (which lacks enable_gqa).
    grouped = q.to(compute).view(num_seqs, hkv, hq // hkv, dim)
    out = sdpa("padded decode", grouped, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, hq, dim).to(q.dtype)


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


@dataclass
class VarlenMeta:
    cu_q: torch.Tensor | slice
    cu_k: torch.Tensor | slice
    max_q: int
    max_k: int
    rows: torch.Tensor | slice | None = None  # flash_varlen: gathered context rows, if any continuation
    block_table: torch.Tensor | slice | None = None  # varlen_paged: [S, max_blocks]
    seqused_k: torch.Tensor | slice | None = None
    num_rows: int = 0


class FlashVarlenBackend(PlainBackend):
    name = "flash_varlen"

    def prepare(self, plan: StepPlan, pack: HostPack):
        p = plan.num_prefill
        decode = _decode_meta(plan, pack, plan.num_prefill_tokens)
        if not p:
            return None, decode
        ends, counts = plan.ends[:p], plan.counts[:p]
        continuing = any(plan.starts[:p])
        k_lens = ends if continuing else counts
        meta = VarlenMeta(pack.add(_cumsum(counts)), pack.add(_cumsum(k_lens)), max(counts), max(k_lens))
        if continuing:
            rows = [
                r for i in range(p) for r in _context_rows(plan.block_tables[i], ends[i], plan.block_size)
            ]
            meta.rows = pack.add(rows)
        return meta, decode

    def bind(self, meta, flat: torch.Tensor):
        varlen, decode = meta
        if varlen is not None:
            varlen.cu_q, varlen.cu_k = flat[varlen.cu_q].int(), flat[varlen.cu_k].int()
            if varlen.rows is not None:
                varlen.rows = flat[varlen.rows]
        return varlen, decode.bind(flat) if decode is not None else None

    def attend(self, q, k, v, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        varlen, decode = meta
        if decode is None:
            return self._prefill(q, k, v, k_cache, v_cache, varlen, scale)
        out = torch.empty_like(q)
        if varlen is not None:
            out[: decode.start] = self._prefill(q[: decode.start], k, v, k_cache, v_cache, varlen, scale)
        out[decode.start :] = paged_decode(
            q[decode.start :], k_cache, v_cache, decode, scale, self.decode_kernel
        )
        return out

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, meta: VarlenMeta, scale: float) -> torch.Tensor:
        if meta.rows is not None:
            k = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, meta.rows)
            v = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, meta.rows)
        else:
            k, v = k[: q.shape[0]], v[: q.shape[0]]
        if k.shape[1] != q.shape[1]:  # this kernel wants as many KV heads as query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return flash_varlen(q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, scale)


class VarlenPagedBackend:
    name = "varlen_paged"

    def prepare(self, plan: StepPlan, pack: HostPack) -> VarlenMeta:
        ends = plan.ends
        width = max(len(t) for t in plan.block_tables)
        table = [b for t in plan.block_tables for b in t + [0] * (width - len(t))]
        meta = VarlenMeta(
            pack.add(_cumsum(plan.counts)), pack.add(_cumsum(ends)), max(plan.counts), max(ends)
        )
        meta.block_table, meta.seqused_k, meta.num_rows = pack.add(table), pack.add(ends), len(ends)
        return meta

    def bind(self, meta: VarlenMeta, flat: torch.Tensor) -> VarlenMeta:
        meta.cu_q, meta.cu_k = flat[meta.cu_q].int(), flat[meta.cu_k].int()
        meta.block_table = flat[meta.block_table].int().view(meta.num_rows, -1)
        meta.seqused_k = flat[meta.seqused_k].int()
        return meta

    def attend(self, q, k, v, k_cache, v_cache, meta: VarlenMeta, scale: float) -> torch.Tensor:
        return varlen_paged(q, k_cache, v_cache, meta, scale)


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal varlen attention (bottom-right aligned when a sequence has more keys than queries).
    Module-level so CPU tests can put a reference implementation in its place."""
    out = torch.ops.aten._flash_attention_forward(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        True,
        False,
        scale=scale,
    )
    return out[0]


def varlen_paged(q, k_cache, v_cache, meta: VarlenMeta, scale: float) -> torch.Tensor:
    """Causal varlen attention reading K/V through a block table (torch >= 2.13)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(
        q.contiguous(),
        k_cache,
        v_cache,
        meta.cu_q,
        meta.cu_k,
        meta.max_q,
        meta.max_k,
        scale=scale,
        window_size=(-1, 0),
        enable_gqa=k_cache.shape[2] != q.shape[1],
        seqused_k=meta.seqused_k,
        block_table=meta.block_table,
    )


def _cumsum(values: list[int]) -> list[int]:
    out, total = [0], 0
    for v in values:
        total += v
        out.append(total)
    return out


BACKENDS = {b.name: b for b in (PlainBackend, FlashVarlenBackend, VarlenPagedBackend)}


def cuda_candidates() -> list[str]:
    """CUDA backends this torch offers, fastest first (feature detection, never version numbers)."""
    names = []
    try:
        from torch.nn.attention.varlen import varlen_attn

        if "block_table" in inspect.signature(varlen_attn).parameters:
            names.append("varlen_paged")
    except ImportError:
        pass
    if hasattr(torch.ops.aten, "_flash_attention_forward"):
        names.append("flash_varlen")
    return names
