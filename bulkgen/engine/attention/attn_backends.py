"""Attention backends over the packed row and the paged cache, chosen once per engine by probing.

- `plain` (CPU, and the fallback everywhere; attn_plain): prefill chunks by per-sequence SDPA; decodes
  all at once, block by block from the cache, with scores, softmax and the weighted sum in float32.
- `flash_varlen` (CUDA, `aten._flash_attention_forward`): every prefill chunk of the step in one
  varlen kernel with cumulative lengths (continuation chunks included: their context is gathered
  from the cache and flash's bottom-right causal alignment needs no mask); decodes as in `plain`.
- `varlen_paged` (CUDA, `torch.nn.attention.varlen.varlen_attn` with `block_table`, torch >= 2.13):
  the whole step, prefill and decode, in one kernel reading K/V straight from the paged cache.

Every backend takes a layer's attention as parameters: its kind's window (flash's `window_size_left`,
the query and the `window - 1` tokens before it), chunked attention (flash_varlen cuts each sequence's
queries at chunk boundaries into varlen pieces that each read their own chunk), sinks (flash returns
each row's log-sum-exp, and a sink with logit s scales the row by sigmoid(lse - s), exactly the mass
the extra softmax column takes) and V heads narrower than K heads (V zero-padded for flash). MLA's
latent head (mla.py, 576 wide in DeepSeek-V3) is wider than any flash kernel takes: those models run
`plain` prefills with the triton (or padded) decode, a refusal `attn_select` logs.
What a backend cannot take it says in `supports`, and `attn_select` keeps only backends that take every
layer of the model: no fused kernel here soft-caps, so soft-capped models run `plain` prefills (with
the triton decode kernel, which does soft-cap).

Flash kernels accumulate scores in float32. `select_backend` tries the CUDA candidates that exist
in this torch, checks each against `plain` on a small packed case, and keeps the first that agrees;
`BULKGEN_ATTENTION=<name>` forces one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bulkgen.engine.attention.attn_plain import (
    SDPA_CHOICES,
    DecodeMeta,
    PlainBackend,
    decode_meta,
    paged_decode,
    sdpa,
    sdpa_choice,
)
from bulkgen.engine.attention.layer_attention import FULL, AttnKind
from bulkgen.engine.kv import kv_cache
from bulkgen.engine.step_plan import HostPack, StepPlan

__all__ = [  # the plain backend's parts, for the callers that take every backend from here
    "BACKENDS",
    "SDPA_CHOICES",
    "DecodeMeta",
    "PlainBackend",
    "cuda_candidates",
    "paged_decode",
    "sdpa",
    "sdpa_choice",
]


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
    window_left: int = -1  # keys before the query each query reads; -1: all (causal)


FLASH_MAX_HEAD = 256  # the widest head flash-attention kernels take


def _head_size(layer) -> str | None:
    """MLA's latent head (DeepSeek-V3: 576 = 512 + 64 rope) is wider than any flash kernel's."""
    if layer.k_dim > FLASH_MAX_HEAD:
        return f"head size {layer.k_dim} (an MLA latent): flash kernels take heads up to {FLASH_MAX_HEAD}"
    return None


def _window_left(kind: AttnKind) -> int:
    return kind.window - 1 if kind.window is not None else -1


def _pieces(kind: AttnKind, start: int, end: int) -> list[tuple[int, int]]:
    """A chunk of queries [start, end) as the pieces that each read one key range: cut at chunk
    boundaries for chunked attention, whole otherwise."""
    if kind.chunk is None:
        return [(start, end)]
    cuts = [start, *range(start - start % kind.chunk + kind.chunk, end, kind.chunk), end]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


class FlashVarlenBackend(PlainBackend):
    name = "flash_varlen"

    def supports(self, layer) -> str | None:
        if layer.softcap is not None:
            return "logit soft-capping: aten's flash kernel has no softcap"
        if layer.kind.window is not None and not _flash_takes_windows():
            return "sliding windows: this torch's _flash_attention_forward takes no window_size_left"
        return _head_size(layer)

    def prepare(self, plan: StepPlan, pack: HostPack, kind: AttnKind = FULL):
        p = plan.num_prefill
        decode = decode_meta(plan, pack, plan.num_prefill_tokens, kind)
        if not p:
            return None, decode
        spans = [  # (sequence, first query, end, first key) of each piece
            (i, a, b, kind.first_visible(a))
            for i in range(p)
            for a, b in _pieces(kind, plan.starts[i], plan.ends[i])
        ]
        counts = [b - a for _, a, b, _ in spans]
        continuing = any(first < a for _, a, _, first in spans)
        k_lens = [b - first for _, _, b, first in spans] if continuing else counts
        meta = VarlenMeta(pack.add(_cumsum(counts)), pack.add(_cumsum(k_lens)), max(counts), max(k_lens))
        meta.window_left = _window_left(kind)
        if continuing:  # every piece's keys from the cache (this step's K/V are written there first)
            bs, tables = plan.block_size, plan.block_tables
            rows = [
                tables[i][pos // bs] * bs + pos % bs for i, _, b, first in spans for pos in range(first, b)
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

    def attend(self, q, k, v, k_cache, v_cache, meta, scale: float, softcap=None, sinks=None) -> torch.Tensor:
        varlen, decode = meta
        if decode is None:
            return self._prefill(q, k, v, k_cache, v_cache, varlen, scale, sinks)
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        if varlen is not None:
            out[: decode.start] = self._prefill(
                q[: decode.start], k, v, k_cache, v_cache, varlen, scale, sinks
            )
        out[decode.start :] = paged_decode(
            q[decode.start :], k_cache, v_cache, decode, scale, self.decode_kernel, softcap, sinks
        )
        return out

    @staticmethod
    def _prefill(q, k, v, k_cache, v_cache, meta: VarlenMeta, scale: float, sinks) -> torch.Tensor:
        if meta.rows is not None:
            k = kv_cache.read_rows(k_cache, meta.rows, q.dtype)
            v = kv_cache.read_rows(v_cache, meta.rows, q.dtype)
        else:
            k, v = k[: q.shape[0]], v[: q.shape[0]]
        if k.shape[1] != q.shape[1]:  # this kernel wants as many KV heads as query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        dv = v.shape[-1]
        if dv < q.shape[-1]:  # MLA: flash wants V heads as wide as K heads; the padding's output is dropped
            v = F.pad(v, (0, q.shape[-1] - dv))
        out, lse = flash_varlen(
            q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, scale, meta.window_left
        )
        return with_sinks(out[..., :dv], lse, sinks)


class VarlenPagedBackend:
    name = "varlen_paged"
    reads_fp8_kv = False  # varlen_attn reads the cache through its block table, with no per-row scales

    def supports(self, layer) -> str | None:
        if layer.softcap is not None:
            return "logit soft-capping: varlen_attn has no softcap"
        if layer.kind.chunk is not None:
            return "chunked attention: varlen_attn reads every sequence from its first block"
        if layer.k_dim != layer.v_dim:
            return "K and V heads of different sizes (MLA): the paged cache cannot pad V for flash"
        return _head_size(layer)

    def prepare(self, plan: StepPlan, pack: HostPack, kind: AttnKind = FULL) -> VarlenMeta:
        ends = plan.ends
        width = max(len(t) for t in plan.block_tables)
        table = [b for t in plan.block_tables for b in t + [0] * (width - len(t))]
        meta = VarlenMeta(
            pack.add(_cumsum(plan.counts)), pack.add(_cumsum(ends)), max(plan.counts), max(ends)
        )
        meta.block_table, meta.seqused_k, meta.num_rows = pack.add(table), pack.add(ends), len(ends)
        meta.window_left = _window_left(kind)
        return meta

    def bind(self, meta: VarlenMeta, flat: torch.Tensor) -> VarlenMeta:
        meta.cu_q, meta.cu_k = flat[meta.cu_q].int(), flat[meta.cu_k].int()
        meta.block_table = flat[meta.block_table].int().view(meta.num_rows, -1)
        meta.seqused_k = flat[meta.seqused_k].int()
        return meta

    def attend(self, q, k, v, k_cache, v_cache, meta: VarlenMeta, scale: float, softcap=None, sinks=None):
        out, lse = varlen_paged(q, k_cache, v_cache, meta, scale, sinks is not None)
        return with_sinks(out, lse, sinks)


def with_sinks(out: torch.Tensor, lse: torch.Tensor | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """out [T, Hq, Dv] of a softmax without sinks, lse [Hq, T] its log-sum-exp -> the output with each
    head's sink logit s in the denominator: out * e^lse / (e^lse + e^s) = out * sigmoid(lse - s)."""
    if sinks is None:
        return out
    weight = torch.sigmoid(lse.float().transpose(0, 1) - sinks.float()[None, :])  # [T, Hq]
    return (out.float() * weight[..., None]).to(out.dtype)


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, window_left: int = -1):
    """Causal varlen attention (bottom-right aligned when a sequence has more keys than queries), each
    query reading at most `window_left` keys before its own (-1: all) -> (out [T, Hq, D], lse [Hq, T]).
    Module-level so CPU tests can put a reference implementation in its place."""
    window = {"window_size_left": window_left, "window_size_right": 0} if window_left >= 0 else {}
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
        **window,
    )
    return out[0], out[1]


def varlen_paged(q, k_cache, v_cache, meta: VarlenMeta, scale: float, lse: bool = False):
    """Causal varlen attention reading K/V through a block table (torch >= 2.13) -> (out, lse or None)."""
    from torch.nn.attention.varlen import AuxRequest, varlen_attn

    out = varlen_attn(
        q.contiguous(),
        k_cache,
        v_cache,
        meta.cu_q,
        meta.cu_k,
        meta.max_q,
        meta.max_k,
        return_aux=AuxRequest(lse=True) if lse else None,
        scale=scale,
        window_size=(meta.window_left, 0),
        enable_gqa=k_cache.shape[2] != q.shape[1],
        seqused_k=meta.seqused_k,
        block_table=meta.block_table,
    )
    return out if lse else (out, None)


def _flash_takes_windows() -> bool:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return op is not None and "window_size_left" in str(op.default._schema)


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
