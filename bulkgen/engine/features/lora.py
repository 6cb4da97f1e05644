"""PEFT LoRA adapters read from a local folder and checked against the model before anything runs.

An adapter is refused at load, with the feature named, when the engine could not apply it exactly:
DoRA (`use_dora`), `modules_to_save` (whole trained copies of modules), LoRA on embeddings or the output
head, LoRA biases, LoRA on MoE experts (peft's `target_parameters` on fused experts, or modules under an
`experts` list: an expert sees only its routed tokens, not the packed row the slots' segments index), a
rank above `EngineConfig.max_lora_rank`, and a target module the model lacks, that is not a plain linear
layer, or that is inside a hybrid model's recurrent mixer (those run sequence by sequence, not on the
packed row the slots' segments index). What passes is a host copy of each targeted linear's (A, B) with
its scale folded into B, so a slot load (lora_slots.py) is a plain copy. The scale is peft's:
`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`, each module's rank read from its weights
and its alpha from `alpha_pattern` where a pattern matches its name (as peft matches). On a
tensor-parallel rank the host copy is that rank's shard (lora_tp.py).

The weights file is checked before use (LoraFileError, a LoraError and a checkpoint_checks.CheckpointError):
its safetensors header (checkpoint_checks.read_header: a garbage file, an absurd header length), each
lora_A / lora_B a matrix of one rank and of the target module's dimensions, and every value finite. Messages
name the adapter and the file within its folder, never the folder's path on the server.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bulkgen.engine.attention.mla import lora_refusal
from bulkgen.engine.model.checkpoint_checks import CheckpointError, check_finite, read_header

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# config keys whose feature the engine does not implement: refused when set to anything but "off"
REFUSED_SETTINGS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save",
    "lora_bias": "LoRA biases (lora_bias)",
    "target_parameters": "LoRA on parameters (target_parameters, e.g. fused MoE experts)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
}
_uids = itertools.count(1)


class LoraError(ValueError):
    """An adapter the engine refuses (its message names the feature), or a request naming an unknown one."""


class LoraFileError(LoraError, CheckpointError):
    """An adapter whose weights file is corrupt or malformed (its message names the file and the tensor)."""


class LoraWrapper(torch.nn.Module):
    """A layer that wraps a linear one to add adapters (lora_slots.LoraLinear): `base` is the layer wrapped.
    Declared here so this module checks targets without importing the one that wraps them."""

    base: torch.nn.Module


@dataclass(eq=False)
class LoraAdapter:
    """One adapter in the host cache: `weights[module] = (A [r, in], B·scale [out, r])` on the CPU.

    `uid` is unique per load, so an adapter removed and added again under the same name never shares
    cached KV blocks with its earlier weights (block_manager salts the hash chain with it)."""

    name: str
    path: str
    rank: int  # the highest of its modules' ranks
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    uid: int = field(default_factory=lambda: next(_uids))


def load_adapter(name: str, path: str | os.PathLike, model: torch.nn.Module, max_rank: int) -> LoraAdapter:
    """Read and check the PEFT folder at `path` against `model`; LoraError naming what is refused."""
    group = getattr(model, "bulkgen_tp", None)  # tensor_parallel.RankGroup: this rank's shard of each pair
    folder = Path(path)
    config = _read_config(name, folder)
    for key, feature in REFUSED_SETTINGS.items():
        if config.get(key) not in (None, False, "none", [], {}):
            raise LoraError(f"adapter {name!r}: {feature} is not supported ({CONFIG_FILE})")
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapter {name!r}: LoRA bias {config['bias']!r} is not supported; use 'none'")
    weights, recurrent = {}, _recurrent_paths(model)
    for module, (a, b) in _read_pairs(name, folder).items():
        inside = next((p for p in recurrent if module.startswith(p + ".")), None)
        if inside is not None:  # its layers run sequence by sequence (hybrid_layers), not on the packed row
            raise LoraError(
                f"adapter {name!r}: LoRA inside the recurrent layer {inside} ({module}) is not supported"
            )
        if ".experts." in f".{module}.":  # an expert runs on its routed tokens only, not the packed row
            raise LoraError(f"adapter {name!r}: LoRA on MoE expert projections ({module}) is not supported")
        rank = a.shape[0]
        if rank > max_rank:
            raise LoraError(f"adapter {name!r}: rank {rank} ({module}) is above max_lora_rank {max_rank}")
        alpha = float(_pattern(config.get("alpha_pattern"), module, config.get("lora_alpha", 8)))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        if group is not None:
            a, b = group.shard_lora(model, module, a, b)
        weights[module] = _checked(name, model, module, a, b, scale)
        parent, _, child = module.rpartition(".")
        refusal = lora_refusal(model.get_submodule(parent), child)  # the module exists: _checked found it
        if refusal:
            raise LoraError(f"adapter {name!r}: {refusal} ({module})")
    return LoraAdapter(name, str(folder), max(a.shape[0] for a, _ in weights.values()), weights)


def _recurrent_paths(model: torch.nn.Module) -> list[str]:
    """Module paths of a hybrid model's recurrent mixers (hybrid_layers.find_mixers)."""
    from bulkgen.engine.features.hybrid_layers import find_mixers

    mixers = {id(m) for m in find_mixers(model).values()}
    return [path for path, module in model.named_modules() if id(module) in mixers]


def _pattern(patterns: dict | None, module: str, default: object) -> object:
    """The value of the first pattern matching `module` (peft's get_pattern_key), else `default`."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(name: str, folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"adapter {name!r} is not a PEFT adapter folder: {CONFIG_FILE} is missing")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE}: not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE}: not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"adapter {name!r}: {CONFIG_FILE}: peft_type {peft_type!r} is not LoRA")
    return config


def _read_pairs(name: str, folder: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path in the model: (A, B)} from the safetensors file, refusing keys that are not a
    linear layer's lora_A / lora_B (embeddings' lora_embedding_*, DoRA magnitudes, saved modules), and a
    file that is not whole (LoraFileError: its header, a tensor that is not a matrix, non-finite values,
    A and B of different ranks)."""
    from safetensors.torch import load_file

    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise LoraError(f"adapter {name!r} is not a PEFT adapter folder: {WEIGHTS_FILE} is missing")
    label = f"adapter {name!r}"
    try:
        read_header(file, label)
    except CheckpointError as exc:
        raise LoraFileError(str(exc)) from None
    try:
        tensors = load_file(str(file))
    except Exception as exc:  # what the header check let through: safetensors' own refusal, one line
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise LoraFileError(f"{label}: {WEIGHTS_FILE}: not readable ({first})") from None
    embedding = next((key for key in tensors if ".lora_embedding_" in key), None)
    if embedding is not None:
        raise LoraError(f"adapter {name!r}: LoRA on an embedding layer ({embedding}) is not supported")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, rest = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        if not module or rest not in ("A.weight", "B.weight"):
            raise LoraError(f"adapter {name!r}: weight {key!r} is not a linear layer's lora_A / lora_B")
        if tensor.dim() != 2 or 0 in tensor.shape:
            raise LoraFileError(
                f"{label}: {WEIGHTS_FILE}: {key} has shape {list(tensor.shape)} (lora_A and lora_B are matrices)"
            )
        if not tensor.is_floating_point():
            raise LoraFileError(f"{label}: {WEIGHTS_FILE}: {key} is {tensor.dtype}, not floating point")
        try:
            check_finite(tensor, label, file, key)
        except CheckpointError as exc:
            raise LoraFileError(str(exc)) from None
        halves.setdefault(module, {})[rest[0]] = tensor
    if not halves:
        raise LoraError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: module {module!r} has lora_A or lora_B but not both")
        if pair["A"].shape[0] != pair["B"].shape[1]:
            raise LoraFileError(
                f"{label}: {WEIGHTS_FILE}: {module} has lora_A {list(pair['A'].shape)} and lora_B "
                f"{list(pair['B'].shape)} of different ranks"
            )
    return {module: (pair["A"], pair["B"]) for module, pair in halves.items()}


def _checked(
    name: str,
    model: torch.nn.Module,
    module: str,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B·scale) in float32 for `module`, after checking it is a linear layer of matching shape."""
    try:
        target = model.get_submodule(module)
    except AttributeError:
        raise LoraError(f"adapter {name!r}: target module {module!r} is not in the model") from None
    if isinstance(target, LoraWrapper):  # another adapter targets it too
        target = target.base
    head = model.get_output_embeddings()
    if isinstance(target, torch.nn.Embedding) or target is head:
        raise LoraError(f"adapter {name!r}: LoRA on the embedding or lm_head ({module}) is not supported")
    if not isinstance(target, torch.nn.Linear):
        raise LoraError(
            f"adapter {name!r}: target module {module!r} is a {type(target).__name__}, not a linear layer"
        )
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
        raise LoraFileError(
            f"adapter {name!r}: {WEIGHTS_FILE}: {module} has LoRA shapes A {list(a.shape)}, B {list(b.shape)}"
        )
    if a.shape[1] != target.in_features or b.shape[0] != target.out_features:
        raise LoraFileError(
            f"adapter {name!r}: {WEIGHTS_FILE}: {module} is {target.in_features} -> {target.out_features} in the model, "
            f"but its LoRA is {a.shape[1]} -> {b.shape[0]} (an adapter of another base model?)"
        )
    return a.float().contiguous(), (b.float() * scale).contiguous()
