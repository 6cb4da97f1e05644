"""`bulkgen plan --tensor-parallel N`: each rank's memory for a model split over N GPUs, from its config
alone (engine/parallel/rank_memory.py), so a model too large for one GPU is sized before any weights are fetched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GIB = 1 << 30
PLAN_DTYPE = "bfloat16"  # what a GPU worker loads (Engine.from_pretrained's default on CUDA)


def has_weights(path: str) -> bool:
    return any(Path(path).glob("*.safetensors")) or any(Path(path).glob("*.bin"))


def plan_memory(path: str, ranks: int) -> dict[str, Any]:
    """Per-rank weights and KV bytes per token in bf16; ValueError if the model does not split N ways."""
    import torch
    from transformers import AutoConfig

    from bulkgen.engine.parallel.rank_memory import rank_memory

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    memory = rank_memory(config, ranks, getattr(torch, PLAN_DTYPE))
    return {
        **memory,
        "dtype": PLAN_DTYPE,
        "whole_model_bytes": rank_memory(config, 1, getattr(torch, PLAN_DTYPE))["weight_bytes"],
    }


def describe_memory(memory: dict[str, Any]) -> str:
    """Two lines in `bulkgen plan`'s table (three for a hybrid model: its recurrent state)."""
    ranks, weights, kv = memory["ranks"], memory["weight_bytes"], memory["kv_bytes_per_token"]
    rows = [
        (
            "memory per rank",
            f"{weights / GIB:,.1f} GiB of {memory['dtype']} weights on each of {ranks} GPU"
            + ("s" if ranks > 1 else "")
            + f" (whole model {memory['whole_model_bytes'] / GIB:,.1f} GiB)",
        ),
        ("KV cache per rank", f"{kv / 1024:,.0f} KiB per token ({GIB // kv:,} tokens per GiB)"),
    ]
    if memory.get(
        "state_bytes_per_sequence"
    ):  # a hybrid's recurrent layers (engine/parallel/shard_hybrid.py)
        rows.append(
            ("recurrent state", f"{memory['state_bytes_per_sequence'] / 1024:,.1f} KiB per sequence per rank")
        )
    return "\n".join(f"{label:<20} {value}" for label, value in rows)
