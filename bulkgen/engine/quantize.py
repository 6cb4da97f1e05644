"""Online FP8 weights (`quantize="fp8"`): the decoder layers' linear layers run as FP8 GEMMs.

Each `nn.Linear` inside the decoder layers (attention projections, dense MLPs; not the embedding, not
the lm_head, whose precision sets every logit) is replaced by an `Fp8Linear`: float8_e4m3fn weights
with one float32 scale per output channel, and activations quantized per token at run time (each row's
absolute maximum maps to e4m3's 448), multiplied by `torch._scaled_mm`, which computes
`(x_q * s_x) @ (w_q * s_w).T` with float accumulation. Per-row activation scales keep a packed step
batch-invariant: a token's output never depends on which other sequences share its step.

`quantize_layers` moves the model to its device one decoder layer at a time and quantizes each layer
there before the next one arrives, so the device holds the FP8 weights so far plus one float layer.

Fused MoE experts (transformers 5 keeps a model's experts as 3-D parameters, e.g. Qwen3-MoE's
`gate_up_proj`) are not `nn.Linear`s and stay in the load dtype, as do routers: `quantize_layers`
logs how many parameters stayed in float.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from . import QUANTIZE_MODES

log = logging.getLogger(__name__)

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


class Fp8Linear(nn.Module):
    """A linear layer with e4m3 weights and per-output-channel scales; activations quantized per token.

    Where `_scaled_mm` cannot run the shape (see scaled_mm_supported) the layer computes the same
    product from the dequantized operands, exact up to the float matmul's own rounding."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)  # e4m3 [out, in]
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)  # float32 [out, 1]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_dtype = out_dtype  # the float layer's dtype: what the next module expects
        self.use_scaled_mm = scaled_mm_supported(weight.device, out_dtype, *reversed(weight.shape))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """The layer's weight quantized where it lies (its device), one scale per output channel."""
        weight, scale = quantize_rows(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(weight, scale, bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        values, scale = quantize_rows(rows)
        if self.use_scaled_mm and rows.shape[0]:
            out = torch._scaled_mm(
                values,
                self.weight.t(),
                scale_a=scale,
                scale_b=self.weight_scale.t(),
                out_dtype=self.out_dtype,
            )
        else:
            dequantized = self.weight.to(self.out_dtype) * self.weight_scale.to(self.out_dtype)
            out = (values.to(self.out_dtype) * scale.to(self.out_dtype)) @ dequantized.t()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 per-channel"


@dataclass
class QuantizeReport:
    """What `quantize_layers` converted: for logs, /v1/models and the memory figures."""

    linears: int = 0  # nn.Linear layers now Fp8Linear
    fallback: int = 0  # of those, layers whose shape _scaled_mm cannot run (dequantized product)
    float_params: int = 0  # decoder-layer parameters left in float (norms, biases, routers, fused experts)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers (what online FP8 converts)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder `layers` list to quantize")
    return layers


def quantize_layers(model: nn.Module, device: torch.device | str, mode: str = "fp8") -> QuantizeReport:
    """Move `model` to `device`, quantizing each decoder layer's linear layers once it is there, one
    layer at a time (the device's peak: the FP8 layers so far, one float layer, and the rest of the model)."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {QUANTIZE_MODES} or None, got {mode!r}")
    report = QuantizeReport()
    layers = decoder_layers(model)
    for layer in layers:
        layer.to(device)
        _quantize_layer(layer, report)
    model.to(device)  # embeddings, final norm, lm_head: kept in the load dtype
    log.info(
        "online fp8: %d linear layers in e4m3 (%d through the dequantized product); "
        "%d decoder-layer parameters stay in float (norms, biases, routers, fused MoE experts)",
        report.linears,
        report.fallback,
        report.float_params,
    )
    return report


def ensure_quantized(model: nn.Module, mode: str | None) -> None:
    """Quantize a model handed to the engine already loaded (a caller's float model), in place on its
    device; one already quantized, online (loading.load_model) or by a checkpoint's own quantizer
    (transformers' `is_quantized`), is left as it is."""
    if mode is None or getattr(model, "is_quantized", False):
        return
    if not any(isinstance(m, Fp8Linear) for m in model.modules()):
        quantize_layers(model, next(model.parameters()).device, mode)


def _quantize_layer(layer: nn.Module, report: QuantizeReport) -> None:
    # by name, so each float linear is released as soon as its FP8 replacement is in place
    names = [name for name, child in layer.named_modules() if type(child) is nn.Linear]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = layer.get_submodule(parent_name)
        fp8 = Fp8Linear.from_linear(getattr(parent, attr))
        setattr(parent, attr, fp8)
        report.linears += 1
        report.fallback += not fp8.use_scaled_mm
    scales = {id(m.weight_scale) for m in layer.modules() if isinstance(m, Fp8Linear)}
    report.float_params += sum(
        p.numel() for p in layer.parameters() if p.dtype != FP8 and id(p) not in scales
    )


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as held (FP8 weights at one byte, their scales at four)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
