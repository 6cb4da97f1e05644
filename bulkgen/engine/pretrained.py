"""What `Engine.from_pretrained` loads: the model, its tokenizer and a vision-language model's encoder, on
this process or over a tensor-parallel group, and the load-time checks that pick between them. The engine
itself is then built the same way whatever was loaded (engine.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from bulkgen.engine.config import EngineConfig
from bulkgen.engine.features.multimodal import (
    VisionTower,
    check_vision_families,
    is_vision_model,
    load_processor,
    load_vision,
)
from bulkgen.engine.model.loading import load_model
from bulkgen.engine.parallel.rank_memory import check_device_fits

if TYPE_CHECKING:
    from bulkgen.engine.parallel.tensor_parallel import Launcher, RankGroup


def load_pretrained(
    path: str, config: EngineConfig, device: str, dtype: torch.dtype, launcher: Launcher | None
) -> tuple[torch.nn.Module, object, VisionTower | None, RankGroup | None]:
    """(model, tokenizer, vision encoder or None, the rank group `model` is rank 0's shard of or None) of the
    local checkpoint at `path` (never a hub download).
    A vision-language checkpoint loads with its processor, whose tokenizer the engine uses (multimodal.load_vision);
    `config.tensor_parallel` > 1 starts the other ranks through `launcher` (tensor_parallel.launch), a
    vision-language model's encoder then running on rank 0 alone (vision_shards)."""
    vision = is_vision_model(path)
    if vision:
        check_vision_families(path)
    else:
        check_device_fits(path, dtype, config.tensor_parallel, device)
    if config.tensor_parallel > 1:
        from bulkgen.engine.parallel.tensor_parallel import launch

        timeout = config.collective_timeout_s
        shard = launch(path, config.tensor_parallel, device, dtype, timeout, launcher, config.quantize)
        if vision:
            tower = VisionTower(shard.vlm, load_processor(path), shard.group)
            return shard.model, tower.processor.tokenizer, tower, shard.group
        model, ranks = shard.model, shard.group
    elif vision:
        model, tower = load_vision(path, device, dtype, config)
        return model, tower.processor.tokenizer, tower, None
    else:
        model, ranks = load_model(path, device, dtype, config.quantize), None
    from transformers import AutoTokenizer

    return model, AutoTokenizer.from_pretrained(path, local_files_only=True), None, ranks


def device_and_dtype(device: str | None, dtype: torch.dtype | str | None) -> tuple[str, torch.dtype]:
    """The device and dtype to load on: CUDA+bf16 if available, else CPU+fp32, unless given; ValueError for
    a dtype name that is no torch dtype."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        return device, torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")
        return device, getattr(torch, dtype)
    return device, dtype


def check_parallel(ranks: RankGroup | None, config: EngineConfig) -> None:
    """An engine of tensor_parallel > 1 runs on a model a rank group loaded (its shard), and only then."""
    if (config.tensor_parallel > 1) != (ranks is not None):
        raise ValueError("tensor_parallel > 1 needs Engine.from_pretrained: each rank loads its own shard")
