"""How the paged KV cache is laid out over a model's layers: groups of layers that share block tables,
and the cache tensors the groups share (vLLM's hybrid KV-cache manager, `kv_cache_coordinator.py`).

Layers of one attention kind (full, one sliding window, one chunk size) read the same tokens of a
sequence, so they keep the same blocks and share one block table; a windowed or chunked kind's table
drops the blocks wholly before what its next query reads, as the sequence runs (block_manager). So that
the memory those blocks held serves any layer, every group has the same number of layers, `slots`: a
block id names one [block_size, kv_heads, head_dim] row in each of the `slots` K and V tensors, and
whichever group holds the id keeps its layers' K/V there, layer i of the group in tensor i. A kind with
more layers than the smallest kind is split into several groups (Gemma 3 27B, 10 full and 52 sliding
layers: one full group and six sliding groups of 10, 10, 10, 10, 10 and 2 layers; a block of the last
one leaves 8 slots unused). One kind (a dense model) is one group of all layers: the layout bulkgen
always had.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bulkgen.engine.attention.layer_attention import FULL, AttnKind, LayerAttention
from bulkgen.engine.kv.kv_cache import row_bytes


@dataclass(frozen=True)
class KVGroup:
    kind: AttnKind
    layers: tuple[int, ...]


class KVLayout:
    """Groups, slots and sizes of a model's KV cache; pure arithmetic (benchmarks use it without a GPU)."""

    def __init__(self, layers: list[LayerAttention | None], by_kind: bool = True) -> None:
        """`layers`: each layer's attention, None for a hybrid model's recurrent layer (no KV: its group
        and slot are -1). `by_kind=False`: every layer in one full group, as if no layer had a window
        (what the cache cost before windows freed blocks; bench_kv_memory compares the two)."""
        shapes = {layer.kv_shape for layer in layers if layer is not None}
        if len(shapes) != 1:
            raise ValueError(
                f"layers with different KV head shapes {sorted(shapes)} (kv heads, K dim, V dim, latent): "
                "bulkgen's paged cache needs one shape for every layer"
            )
        self.layers = layers
        self.kv_heads, self.k_dim, self.v_dim, self.latent = shapes.pop()
        members: dict[AttnKind, list[int]] = {}
        for i, layer in enumerate(layers):
            if layer is not None:
                members.setdefault(layer.kind if by_kind else FULL, []).append(i)
        self.slots = min(len(ids) for ids in members.values())
        self.groups = [
            KVGroup(kind, tuple(ids[i : i + self.slots]))
            for kind, ids in members.items()
            for i in range(0, len(ids), self.slots)
        ]
        self.layer_group = [-1] * len(layers)
        self.layer_slot = [-1] * len(layers)
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                self.layer_group[layer], self.layer_slot[layer] = g, slot

    @property
    def kinds(self) -> list[AttnKind]:
        """Each group's kind, in group order (what the block manager keeps tables for)."""
        return [g.kind for g in self.groups]

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block id: a row of every slot's K and V tensor stored in `dtype` (an FP8 cache's
        per-row scales included: kv_cache.row_bytes). A latent layout stores V inside K: K's bytes only."""
        return self.slots * block_size * self.kv_heads * self._head_bytes(dtype)

    def token_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one token's K and V take over every layer with attention, stored in `dtype` (what a
        token costs where no window has freed its blocks)."""
        layers = sum(layer is not None for layer in self.layers)
        return layers * self.kv_heads * self._head_bytes(dtype)

    def _head_bytes(self, dtype: torch.dtype) -> int:
        """One token's K and V row bytes for one KV head (K's alone under MLA's latent cache)."""
        return row_bytes(self.k_dim, dtype) + (0 if self.latent else row_bytes(self.v_dim, dtype))

    def peak_blocks(self, num_tokens: int, step_tokens: int, block_size: int) -> int:
        """The most block ids one sequence of `num_tokens` tokens holds at once, over all groups, when a
        step computes at most `step_tokens` of its tokens (a windowed group needs its window behind the
        step's first token plus the step's own tokens)."""
        return sum(group_peak(kind, num_tokens, step_tokens, block_size) for kind in self.kinds)


def group_peak(kind: AttnKind, num_tokens: int, step_tokens: int, block_size: int) -> int:
    whole = -(-num_tokens // block_size)
    if kind.is_full:
        return whole
    reach = kind.window if kind.window is not None else kind.chunk
    return min(whole, -(-(reach - 1 + step_tokens) // block_size) + 1)
