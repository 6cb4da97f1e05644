"""Per-sequence state slots of hybrid models: the fixed-size state of their linear-attention, Mamba and
short-convolution layers, owned by the engine beside the paged KV cache.

A recurrent layer keeps, per sequence, a short-convolution state (the last kernel-size inputs of its
causal conv) and, for Gated DeltaNet and Mamba-2, a recurrent state (a matrix per head). Its size does
not grow with the context, so it lives in slots rather than blocks: one slot index per running sequence,
the same row of every hybrid layer's tensors ([slots + 1, ...] each; the last row is scratch, which the
padded rows of a decode graph read and write).

A sequence takes a slot at admission and gives it back at finish, abort and preemption (a preempted
sequence is recomputed from its tokens: its state is not kept). A state cannot be rebuilt from cached
KV blocks, so prefix caching is off for these models. The pool also counts, per slot, the tokens its
state has absorbed: a forward that raised part-way leaves the slot marked dirty, and running a
sequence whose slot does not match its computed tokens is an error, never a silently wrong token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from bulkgen.engine.sequence import Sequence
from bulkgen.engine.step_features import StepFeature

log = logging.getLogger(__name__)

DIRTY = -1  # a slot whose state a failed forward may have half-written


@dataclass(frozen=True)
class StateShape:
    """One state tensor of one hybrid layer, per sequence (no batch dimension)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class LayerStates:
    """The states of one hybrid layer, by transformers' state_idx (most layers have one of each)."""

    conv: tuple[StateShape, ...]
    recurrent: tuple[StateShape, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.conv + self.recurrent)


@dataclass
class StateStep:
    """Where each sequence of a packed step sits in the row and which slot holds its state."""

    # (query offset, tokens, slot, continues a state) of each prefill chunk, in row order
    prefill: list[tuple[int, int, int, bool]] = field(default_factory=list)
    decode_start: int = 0  # row of the first decode (one token each, to the end of the row)
    decode_slots: torch.Tensor | None = None  # int64 [decodes] on the device


def slot_bytes(layers: dict[int, LayerStates]) -> int:
    """Bytes of one sequence's slot across every hybrid layer: what each running sequence costs beside
    its KV blocks, whatever its context length."""
    return sum(layer.nbytes for layer in layers.values())


class StatePool(StepFeature):
    """Slot tensors for every hybrid layer, and which sequence holds which slot: the step feature of a hybrid
    model (step_features.py). A running sequence holds a slot, so admission stops when slots or blocks run
    out, whichever first."""

    def __init__(self, layers: dict[int, LayerStates], num_slots: int, device: torch.device) -> None:
        self.layers = layers
        self.num_slots = num_slots
        self.scratch = num_slots  # the extra row: padded decode rows read and write it
        self.conv: dict[int, list[torch.Tensor]] = {}
        self.recurrent: dict[int, list[torch.Tensor]] = {}
        for idx, spec in layers.items():
            self.conv[idx] = [self._zeros(s, device) for s in spec.conv]
            self.recurrent[idx] = [self._zeros(s, device) for s in spec.recurrent]
        self.bytes_per_slot = slot_bytes(layers)
        self.step = None  # the forward in progress' StateStep (scope, hybrid_layers.state_scope)
        self.reset()

    def _zeros(self, state: StateShape, device: torch.device) -> torch.Tensor:
        return torch.zeros((self.num_slots + 1, *state.shape), dtype=state.dtype, device=device)

    def reset(self) -> None:
        """Every slot free (an engine reset); stale contents are never read: a prefill writes first."""
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.slot_of: dict[int, int] = {}  # seq_id -> slot
        self.absorbed = [0] * self.num_slots  # tokens the slot's state holds

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def reserved_bytes(self) -> int:
        """The slots' bytes (and the scratch row's), taken from the cache budget before KV blocks."""
        return self.bytes_per_slot * (self.num_slots + 1)

    def configure(self, config):
        """Prefix caching off: a state cannot be rebuilt from cached KV blocks."""
        if config.enable_prefix_caching:
            log.info(
                "prefix caching is off: a hybrid model's recurrent state cannot be rebuilt from cached blocks"
            )
        return replace(config, enable_prefix_caching=False)

    @property
    def graph_pool(self) -> StatePool:
        return self

    def has_room(self) -> bool:
        return bool(self.free)

    def on_void(self, seq: Sequence, recompute) -> None:
        """Its state absorbed the wrong token: start it over."""
        recompute(seq)

    def packed(self, ordered: list[tuple[Sequence, int]], num_prefill: int) -> tuple[StateStep, list[int]]:
        """The StateStep of a packed row (its decode slots still to be read from the upload) and the
        decodes' slots to upload."""
        slot, step, q_off = self.slot, StateStep(), 0
        for seq, n in ordered[:num_prefill]:
            step.prefill.append((q_off, n, slot(seq), seq.num_computed_tokens > 0))
            q_off += n
        step.decode_start = q_off
        return step, [slot(seq) for seq, _ in ordered[num_prefill:]]

    def scope(self, step: StateStep, flat: torch.Tensor, uploaded: slice):
        """`holding` a packed row's `step`, its decode slots read from the step's upload."""
        step.decode_slots = flat[uploaded] if uploaded.stop > uploaded.start else None
        return self.holding(step)

    @contextmanager
    def holding(self, step: StateStep | None) -> Iterator[None]:
        """Hand `step` to the wrapped mixers for one engine forward. The pool carries it, not a forward
        kwarg: some decoder layers call their mixer without passing kwargs on (LFM2 in transformers 5.17)."""
        self.step = step
        try:
            yield
        finally:
            self.step = None

    def take(self, seq: Sequence) -> None:
        """Give an admitted `seq` a slot; the caller checked `num_free`."""
        slot = self.free.pop()
        self.slot_of[seq.seq_id] = slot
        self.absorbed[slot] = 0

    def release(self, seq: Sequence) -> None:
        """Free `seq`'s slot, if it holds one (finish, abort, preemption)."""
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self.free.append(slot)

    def slot(self, seq: Sequence) -> int:
        """`seq`'s slot; a tensor-parallel follower's stand-in carries rank 0's (plan_codec.StandIn)."""
        held = getattr(seq, "state_slot", None)
        return self.slot_of[seq.seq_id] if held is None else held

    def begin(self, items: list[tuple[Sequence, int]]) -> None:
        """Check that each of a step's sequences holds a slot whose state has absorbed exactly its
        computed tokens, then mark the slots dirty until `commit`."""
        for seq, _ in items:
            slot = self.slot_of.get(seq.seq_id)
            if slot is None or self.absorbed[slot] != seq.num_computed_tokens:
                held = None if slot is None else self.absorbed[slot]
                raise RuntimeError(
                    f"state slot of sequence {seq.seq_id} holds {held} tokens but {seq.num_computed_tokens} "
                    "are computed (a failed step leaves hybrid state half-written: reset the engine)"
                )
            self.absorbed[slot] = DIRTY

    def commit(self, items: list[tuple[Sequence, int]]) -> None:
        """The step's forward completed: each slot now holds its sequence's tokens up to the step's end."""
        for seq, n in items:
            self.absorbed[self.slot_of[seq.seq_id]] = seq.num_computed_tokens + n
