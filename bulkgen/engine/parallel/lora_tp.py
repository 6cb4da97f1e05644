"""LoRA adapters on a tensor-parallel model (tensor_parallel.py): each rank holds its shard of every adapter,
split like the base weight it adds to, and every rank's slots hold the same adapters (vLLM's
column_parallel_linear / row_parallel_linear LoRA layers, written for our slots).

- Column-parallel targets (q/k/v, gate/up): A is replicated, B split by output rows like the base weight
  (KV heads fewer than ranks: the replicated head's rows; a packed gate_up: each half's rows). Each rank
  adds the delta of its own output rows; nothing to reduce.
- Row-parallel targets (o, down): A split by input columns like the base weight, so each rank's shrink is
  a partial sum of x·Aᵀ; those partials (tokens × rank, tiny) are all-reduced in one collective per layer,
  B is replicated, and every rank adds the same expand to the base's already all-reduced output. That is
  the single-process engine's own order (whole base output, then `addmm_` of the whole shrink by B), so
  the delta is exact up to the split GEMMs the base already has; adding it into rank 0's partial sum
  before the base's all-reduce would round it at the partial's magnitude and sum it in the collective's
  order instead, and would still need the shrink's all-reduce first. (vLLM adds each rank's partial
  delta, its slice's shrink times the whole B, before the base's all-reduce: no extra collective, its
  sum in the collective's order; one all-reduce of tokens × rank per layer is what ours costs.)

Each split is its base layer's type's (layers.py: `shard_lora`, `lora_reduces`); this module finds the
type of the layer an adapter targets. The rank group (tensor_parallel.RankGroup.shard_lora / lora_reduce) hands these to the LoRA feature, which
never imports this module: lora.load_adapter asks for each pair's shard, lora_slots.LoraSlots for the
reduce of each layer it wraps. Which adapter sits in which slot travels in the step plan (lora_plan.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bulkgen.engine.parallel.layers import layer_of
from bulkgen.engine.parallel.shard_families import in_block
from bulkgen.engine.parallel.sharding import tp_plan


def shard_pair(
    model: torch.nn.Module, module: str, a: torch.Tensor, b: torch.Tensor, rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s (A, B) of `module` on a model split over `world` ranks (unchanged where the shapes do
    not split: lora._checked then names the mismatch; whole in a group of one)."""
    if world == 1:
        return a, b
    try:
        target = model.get_submodule(module)
    except AttributeError:
        return a, b
    target = getattr(target, "base", target)  # a LoraLinear another adapter already wrapped
    if not isinstance(target, torch.nn.Linear) or a.dim() != 2 or b.dim() != 2:
        return a, b
    return layer_of(tp_plan(model), module).shard_lora(target, a, b, rank, world)


def row_parallel_reduce(
    model: torch.nn.Module, module: str, all_reduce: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The all-reduce (the group's `all_reduce`) a row-parallel target's shrink needs (its A holds a slice of
    the input columns); None for any other layer, and for one inside an MoE block reduced once at its output."""
    reduces = layer_of(tp_plan(model), module).lora_reduces and not in_block(model, module)
    return all_reduce if reduces else None
