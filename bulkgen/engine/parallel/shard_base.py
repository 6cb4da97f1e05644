"""The floor of the tensor-parallel wing: what every family's sharding rules share (sharding.py,
layers.py, shard_quantized.py, shard_gptoss.py): a plan's style for a name, parameters built on meta and
allocated at load, and the checkpoint's safetensors files (the slice of a checkpoint tensor a rank holds is
its layer type's: layers.py). It imports nothing of the wing, so the wing's modules import it and never each other
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
