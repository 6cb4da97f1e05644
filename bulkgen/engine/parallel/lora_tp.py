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

Rank 0 decides which adapter sits in which slot (LoraSlots.activate, its LRU); the step plan
(plan_codec.py) carries that assignment, the set of adapters loaded when it changed, and each row's
adapter uid. Rank 0 publishes each adapter's folder in the rendezvous store under its uid, once; a
follower loads its own shard from there and copies the assignment (`follow`), so its slots, its row order
(sorted by uid) and its segments are rank 0's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bulkgen.engine.features.lora import load_adapter


@dataclass
class LoraPlan:
    """One step's LoRA section of the plan: rank 0's slot of each resident adapter (by uid) and, when it
    changed since the previous step, the uids of every adapter rank 0 holds (None: unchanged)."""

    resident: dict[int, int]
    loaded: list[int] | None


class AdapterRef:
    """A follower stand-in's adapter: the uid rank 0 gave it, which the runner sorts and slots rows by."""

    __slots__ = ("uid",)

    def __init__(self, uid: int) -> None:
        self.uid = uid


def shard_pair(
    model: torch.nn.Module, module: str, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of `module` on a tensor-parallel model (unchanged on a whole model, or where the
    shapes do not split: lora._checked then names the mismatch)."""
    group = getattr(model, "bulkgen_tp", None)
    if group is None:
        return a, b
    from bulkgen.engine.parallel.shard_packed import qkv_rows
    from bulkgen.engine.parallel.sharding import packed_half, shard_slice, style_of, tp_plan

    try:
        target = model.get_submodule(module)
    except AttributeError:
        return a, b
    target = getattr(target, "base", target)  # a LoraLinear another adapter already wrapped
    if not isinstance(target, torch.nn.Linear) or a.dim() != 2 or b.dim() != 2:
        return a, b
    style, rank, world = style_of(tp_plan(model), module), group.rank, group.world
    out, width = target.out_features, b.shape[0]
    if style == "colwise" and width != out and width % out == 0:
        b = b[shard_slice((width, b.shape[1]), (out, b.shape[1]), rank, world)]
    elif style == "packed_colwise" and width == out * world and out % 2 == 0:  # each half's rows
        b = torch.cat([packed_half(b, tuple(b.shape), part, rank, world) for part in (0, 1)])
    elif style == "packed_qkv" and width != out:  # its heads' rows of each of q, k and v
        b = qkv_rows(b, tuple(b.shape), style, rank, world)
    elif style == "rowwise" and a.shape[1] == target.in_features * world:
        a = a[shard_slice(tuple(a.shape), (a.shape[0], target.in_features), rank, world)]
    return a, b


def row_parallel_reduce(model: torch.nn.Module, module: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The all-reduce a row-parallel target's shrink needs (its A holds a slice of the input columns);
    None for any other layer, and for one inside an MoE block reduced once at its output."""
    group = getattr(model, "bulkgen_tp", None)
    if group is None:
        return None
    from bulkgen.engine.parallel.shard_families import in_block
    from bulkgen.engine.parallel.sharding import style_of, tp_plan

    rowwise = style_of(tp_plan(model), module) == "rowwise" and not in_block(model, module)
    return group.all_reduce if rowwise else None


def publish(slots, store) -> None:
    """Rank 0: put each adapter's name and folder in the store under its uid, once per adapter."""
    for adapter in slots.adapters.values():
        if adapter.uid not in slots.published:
            store.set(f"lora/{adapter.uid}", json.dumps({"name": adapter.name, "path": adapter.path}))
            slots.published.add(adapter.uid)


def follow(slots, plan: LoraPlan, store) -> None:
    """A follower: hold the adapters rank 0 holds (dropping removed ones, loading new ones' shards from
    the folders rank 0 published), then put them in rank 0's slots."""
    if plan.loaded is not None:
        keep = set(plan.loaded)
        for name in [n for n, a in slots.adapters.items() if a.uid not in keep]:
            slots.remove(name)
        held = {a.uid for a in slots.adapters.values()}
        for uid in plan.loaded:
            if uid not in held:
                meta = json.loads(store.get(f"lora/{uid}"))
                adapter = load_adapter(meta["name"], meta["path"], slots.model, slots.max_rank)
                adapter.uid = uid  # rank 0's: rows are sorted and slotted by it
                slots.add(adapter)
    slots.place(plan.resident)
