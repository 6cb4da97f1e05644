"""Online FP8 for fused MoE experts: the 3-D expert weights transformers 5 keeps in one module.

transformers marks such a module with `use_experts_implementation` (it then has `has_gate`, `has_bias`,
`is_transposed`: Qwen3-MoE's [experts, out, in] weights, gpt-oss' transposed [experts, in, out] ones
with biases). Each expert's projections are stored as e4m3 [experts, out, in] with one float32 scale
per (expert, output channel), and the module's forward becomes `fp8_experts_forward`: for each expert a
step routes tokens to, its tokens quantized per token and multiplied with `fp8.fp8_matmul`, the
gate (the module's own `_apply_gate`: gpt-oss clamps and scales it), the down projection, and the
routing weights, as transformers' own experts functions compute them.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from bulkgen.engine.model.fp8 import fp8_matmul, quantize_rows, scaled_mm_supported


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers experts module whose weights are one 3-D parameter per projection."""
    down = getattr(module, "down_proj", None)
    return hasattr(module, "has_gate") and isinstance(down, nn.Parameter) and down.ndim == 3


def quantize_experts(module: nn.Module) -> None:
    """Replace the module's expert weights by e4m3 ones with per-(expert, channel) scales, in place on
    their device, and switch its forward to fp8_experts_forward."""
    for name in (_up_name(module), "down_proj"):
        weight = getattr(module, name).detach()
        if module.is_transposed:
            weight = weight.transpose(1, 2)  # -> [experts, out, in]
        experts, out_features, in_features = weight.shape
        out_dtype = weight.dtype
        values, scale = quantize_rows(weight.reshape(experts * out_features, in_features))
        delattr(module, name)
        module.register_parameter(
            name, nn.Parameter(values.reshape(experts, out_features, in_features), requires_grad=False)
        )
        module.register_parameter(
            f"{name}_scale", nn.Parameter(scale.reshape(experts, out_features, 1), requires_grad=False)
        )
    module.fp8_out_dtype = out_dtype
    module.fp8_scaled_mm = scaled_mm_supported(values.device, out_dtype, in_features, out_features) and (
        scaled_mm_supported(values.device, out_dtype, out_features, in_features)
    )
    module.forward = types.MethodType(fp8_experts_forward, module)


def fp8_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' output [tokens, hidden] for tokens routed to `top_k_index` with `top_k_weights`."""
    final = torch.zeros_like(hidden_states)
    up = _up_name(self)
    for expert in top_k_index.unique().tolist():
        if expert >= self.num_experts:  # expert-parallel sentinel: not this rank's
            continue
        token_idx, slot = torch.where(top_k_index == expert)
        states = _fp8_project(self, up, expert, hidden_states[token_idx])
        states = self._apply_gate(states) if self.has_gate else self.act_fn(states)
        states = _fp8_project(self, "down_proj", expert, states)
        if getattr(self, "has_post_expert_norm", False):
            states = self.post_expert_norm(states)
        states = states * top_k_weights[token_idx, slot, None]
        final.index_add_(0, token_idx, states.to(final.dtype))
    return final


def _fp8_project(self: nn.Module, name: str, expert: int, states: torch.Tensor) -> torch.Tensor:
    weight, scale = getattr(self, name)[expert], getattr(self, f"{name}_scale")[expert]
    out = fp8_matmul(states.to(self.fp8_out_dtype), weight, scale, self.fp8_out_dtype, self.fp8_scaled_mm)
    if self.has_bias:
        out = out + getattr(self, f"{name}_bias")[expert]
    return out


def _up_name(module: nn.Module) -> str:
    return "gate_up_proj" if module.has_gate else "up_proj"
