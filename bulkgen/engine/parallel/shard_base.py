"""The floor of the tensor-parallel wing: what every family's sharding rules share (sharding.py,
shard_packed.py, shard_quantized.py, shard_gptoss.py, lora_tp.py): a plan's style for a name, the slice of a
checkpoint tensor a rank holds, parameters built on meta and allocated at load, and the checkpoint's
safetensors files. It imports nothing of the wing, so the wing's modules import it and never each other
in a circle."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn


def style_of(plan: dict[str, str], name: str) -> str | None:
    """The plan's style for a module or parameter name (layer indices matched by `*`)."""
    return plan.get(re.sub(r"\.\d+(?=\.|$)", ".*", name))


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules whose parameters take no memory (they are allocated shard by shard at load) while
    buffers (rotary frequencies) are computed for real, as accelerate's init_empty_weights does."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def shard_slice(full: tuple[int, ...], local: tuple[int, ...], rank: int, world: int) -> tuple | None:
    """Index of this rank's part of a checkpoint tensor of shape `full` for a parameter of shape `local`
    (None: the whole tensor): the one dimension where they differ is the split one."""
    if full == local:
        return None
    dim = next(d for d in range(len(full)) if full[d] != local[d])
    chunks = full[dim] // local[dim]
    index = rank * chunks // world  # KV heads fewer than ranks: neighbours share one
    return (slice(None),) * dim + (slice(index * local[dim], (index + 1) * local[dim]),)


def packed_half(view, full: tuple[int, ...], part: int, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of half `part` of a packed gate_up (a checkpoint view or a tensor, e.g. a LoRA
    B: lora_tp.py), so each half splits over the ranks like an unpacked one."""
    rows = full[-2] // 2 // world
    start = part * full[-2] // 2 + rank * rows
    return view[(slice(None),) * (len(full) - 2) + (slice(start, start + rows),)]


def materialize(model: nn.Module, name: str, params: dict, dtype, device) -> nn.Parameter:
    """The parameter `name`, allocated on `device` if it is still on meta (every module sharing it sees
    the new one: tied embeddings)."""
    old = params[name]
    if not old.is_meta:
        return old
    new = nn.Parameter(torch.empty(old.shape, dtype=dtype, device=device), requires_grad=False)
    for other, param in list(params.items()):
        if param is old:
            owner, _, attr = other.rpartition(".")
            setattr(model.get_submodule(owner), attr, new)
            params[other] = new
    return new


def safetensors_files(path: Path) -> list[Path]:
    from bulkgen.engine.model.checkpoint_checks import checkpoint_files

    files = checkpoint_files(path)
    if not files:
        raise ValueError(f"no safetensors weights at {path}: tensor parallel loads only safetensors")
    return files
