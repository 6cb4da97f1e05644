"""What one layer's paged K or V cache stores: rows in the model's dtype, or FP8 (e4m3) rows with a scale.

`EngineConfig.kv_cache_dtype` "auto" keeps K/V in the model's dtype (a plain tensor [blocks + 1,
block_size, kv_heads, dim]). "fp8" (alias "fp8_e4m3") keeps them as `Fp8Cache`: the same rows in
float8_e4m3fn and, beside them, one float32 scale per token and KV head ([blocks + 1, block_size,
kv_heads]); a row is `data * scale`. Every attention path writes through `write` and reads through
`read_rows` / `read_blocks` (or, in the triton decode kernel, loads the FP8 row and multiplies by its
scale), so a backend never sees which one it has beyond those calls.

Why a dynamic scale per token and head rather than one static scale per layer (vLLM's default, from a
checkpoint's k_scale / v_scale, or 1.0): e4m3 keeps about 3 significant bits over a range of 2^-9 .. 448,
so its error is relative as long as a value sits in that range. One scale per layer must cover the
layer's largest K (the attention-sink tokens' keys are often 10-100x the rest) and pushes the small
heads and tokens into e4m3's subnormals, or clips the large ones; a scale per row puts each row's largest
element at 448, so every row keeps its 3 bits whatever the other rows hold, and no calibration data or
checkpoint scale is needed. The price is 4 bytes per token and head beside the head's `dim` bytes:
at head dim 128 a block holds 1.94x the tokens of a bf16 block (1.88x at head dim 64) instead of 2x.
A row is written once and never rescaled, so appending a token never touches the rows before it.

Every attention reads K/V as stored: a fresh prefill chunk attends to its own K/V rounded to FP8 too
(`write` returns them), so a sequence's tokens do not depend on whether its context was computed in this
step, an earlier chunk, came from the prefix cache or was recomputed after a preemption. MLA layers
(one latent row per token whose leading columns are V: `leading`, one scale for the row) and windowed or
chunked groups go through the same calls. The recurrent state of hybrid models (state_slots) is not KV and stays in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
SCALE_DTYPE = torch.float32
_MIN_SCALE = 1e-12  # an all-zero row (the scratch block, padding) keeps a finite scale


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype K/V rows are stored in for `kv_cache_dtype` `name` (one of KV_CACHE_DTYPES: EngineConfig
    checks it)."""
    return model_dtype if name == "auto" else FP8


def row_bytes(dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K (or V) takes for one KV head: its elements, and its scale when FP8."""
    element = torch.empty((), dtype=dtype).element_size()
    return dim * element + (torch.empty((), dtype=SCALE_DTYPE).element_size() if dtype == FP8 else 0)


@dataclass
class Fp8Cache:
    """One layer slot's K or V rows in FP8, each with its scale."""

    data: torch.Tensor  # [blocks + 1, block_size, kv_heads, dim] float8_e4m3fn
    scale: torch.Tensor  # [blocks + 1, block_size, kv_heads] float32: a row is data * scale

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def clone(self) -> Fp8Cache:
        return Fp8Cache(self.data.clone(), self.scale.clone())


KVCache = torch.Tensor | Fp8Cache


def allocate(rows: tuple[int, int, int], dim: int, dtype: torch.dtype, device: torch.device) -> KVCache:
    """A zeroed cache of `rows` (blocks + 1, block_size, kv_heads) rows of `dim` elements."""
    if dtype != FP8:
        return torch.zeros(*rows, dim, dtype=dtype, device=device)
    return Fp8Cache(
        torch.zeros(*rows, dim, dtype=FP8, device=device),
        torch.zeros(*rows, dtype=SCALE_DTYPE, device=device),
    )


def leading(cache: KVCache, dim: int) -> KVCache:
    """The first `dim` columns of every row, as a view sharing the cache's memory (and, FP8, its scales):
    MLA's V, the latent c_kv, is the leading part of its K row [c_kv, k_pe] (mla.py)."""
    if not isinstance(cache, Fp8Cache):
        return cache[..., :dim]
    return Fp8Cache(cache.data[..., :dim], cache.scale)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., dim] -> (FP8 rows [..., dim], float32 scales [...]): each row's largest element at 448."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scale[..., None]).to(dtype)


def write(cache: KVCache, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Store this step's x [T, kv_heads, dim] at cache rows `slots` [T] (block * block_size + offset);
    return x as the cache holds it (in x's dtype), which is what this step attends to."""
    if not isinstance(cache, Fp8Cache):
        cache.view(-1, *x.shape[1:]).index_copy_(0, slots, x)
        return x
    data, scale = quantize(x)
    # CPU's index_copy_ has no FP8 kernel: the bytes are copied as bytes
    cache.data.view(torch.uint8).view(-1, *x.shape[1:]).index_copy_(0, slots, data.view(torch.uint8))
    cache.scale.view(-1, x.shape[1]).index_copy_(0, slots, scale)
    return dequantize(data, scale, x.dtype)


def read_rows(cache: KVCache, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows `rows` [n] -> [n, kv_heads, dim] (a float cache's rows as stored, FP8 ones in `dtype`)."""
    if not isinstance(cache, Fp8Cache):
        return cache.view(-1, *cache.shape[2:]).index_select(0, rows)
    data = cache.data.view(-1, *cache.shape[2:]).index_select(0, rows)
    return dequantize(data, cache.scale.view(-1, cache.shape[2]).index_select(0, rows), dtype)


def read_blocks(cache: KVCache, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whole blocks `table` [B, W] -> [B, W, block_size, kv_heads, dim] in `dtype`."""
    if not isinstance(cache, Fp8Cache):
        return cache[table].to(dtype)
    return dequantize(cache.data[table], cache.scale[table], dtype)
