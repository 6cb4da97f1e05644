"""FP8 (e4m3) arithmetic the quantized modules share: per-row quantization and the scaled product.

`torch._scaled_mm` computes `(x_q * s_x) @ (w_q * s_w).T` with float accumulation from e4m3 operands
and per-row / per-column float32 scales. Where it cannot run a shape (scaled_mm_supported), the same
product is computed from the dequantized operands, exact up to the float matmul's own rounding.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# the smallest scale: an all-zero row or channel must not divide by zero
_MIN_SCALE = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and float32 scales [rows, 1] of a 2-D tensor, one scale per row (row max -> 448)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=_MIN_SCALE) / FP8_MAX
    # clamp: a value that rounds past 448 would cast to NaN (e4m3fn has no infinity)
    # in place on one float32 copy of x: the loading peak's only transient besides the FP8 result
    values = x.to(torch.float32, copy=True).div_(scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale


def scaled_mm_supported(
    device: torch.device, dtype: torch.dtype, in_features: int, out_features: int
) -> bool:
    """Whether `torch._scaled_mm` with row-wise scales runs for this layer. On CPU it runs for every
    shape and output dtype tried (torch 2.13: float32 and bfloat16). CUDA's row-wise FP8 GEMM
    (cuBLASLt, sm89+) wants a bfloat16 output and both matrix dimensions multiples of 16."""
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return (major, minor) >= (8, 9) and dtype == torch.bfloat16 and in_features % 16 == out_features % 16 == 0


def fp8_matmul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype, scaled_mm: bool
) -> torch.Tensor:
    """x [rows, in] (float) times e4m3 weight [out, in] with scales [out, 1]: x quantized per row first."""
    values, scale = quantize_rows(x)
    if scaled_mm and x.shape[0]:
        return torch._scaled_mm(
            values, weight.t(), scale_a=scale, scale_b=weight_scale.t(), out_dtype=out_dtype
        )
    dequantized = weight.to(out_dtype) * weight_scale.to(out_dtype)
    return (values.to(out_dtype) * scale.to(out_dtype)) @ dequantized.t()
