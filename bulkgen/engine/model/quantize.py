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
`gate_up_proj`) are quantized the same way per expert and output channel (quantize_experts.py);
routers, norms and biases stay in the load dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from bulkgen.engine import QUANTIZE_MODES
from bulkgen.engine.model.fp8 import FP8, fp8_matmul, quantize_rows, scaled_mm_supported
from bulkgen.engine.model.quantize_experts import is_fused_experts, quantize_experts

log = logging.getLogger(__name__)


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
        out = fp8_matmul(rows, self.weight, self.weight_scale, self.out_dtype, self.use_scaled_mm)
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
    experts: int = 0  # fused MoE expert modules now in e4m3 (quantize_experts.py)
    float_params: int = 0  # decoder-layer parameters left in float (norms, biases, routers)


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
        "online fp8: %d linear layers (%d through the dequantized product) and %d fused MoE expert modules "
        "in e4m3; %d decoder-layer parameters stay in float (norms, biases, routers)",
        report.linears,
        report.fallback,
        report.experts,
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
    for module in list(layer.modules()):
        if is_fused_experts(module):
            quantize_experts(module)
            report.experts += 1
    report.float_params += sum(
        p.numel() for name, p in layer.named_parameters() if p.dtype != FP8 and not name.endswith("scale")
    )


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as held (FP8 weights at one byte, their scales at four)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
