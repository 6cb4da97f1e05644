"""The step-feature seam: what the scheduler, the model runner and the overlapped path call on a feature that
changes what a step is, so that none of them names the feature (issue 47: "the less common the feature, the
more it should be hidden").

A feature is chosen once, when the runner is built: a hybrid model's state slots are a `StatePool`
(state_slots.py), a vision-language model's images a `VisionTower` (multimodal.py), a sharded model's ranks
a `RankGroup` (tensor_parallel.py); a model without one gets the no-op object of this module in its place,
never an `if` in the step. The hooks are those the step path needs, derived from the branches they replace:
the scheduler asks `has_room` and `fits` before admitting and calls `take`/`release` around a sequence's
life (`Features` when it takes several: state slots and lora_slots.AdapterRows); the runner takes its
attention backend from `route`, adds to the step plan with `plan`, wraps each forward in `begin`/`commit`
and `scope`, hands the packed row to `packed` and builds the model's inputs with `inputs`; the overlapped
path calls `on_void` for a sequence whose launched token was corrected late. LoRA's rows in the runner are
lora_slots.LoraSlots' own (`prepare`, `order`, `scope`): always there, a no-op while no adapter is used.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from bulkgen.engine.sequence import Sequence

NO_SCOPE = nullcontext()  # reusable: entering it does nothing


class StepFeature:
    """The seam's hooks, each a no-op: the object a model without the feature holds. A feature overrides
    the hooks it needs."""

    reserved_bytes = 0  # bytes of the cache budget the feature takes before KV blocks are sized
    decode_graphs = True  # whether decode steps may replay CUDA graphs (their static buffers: 1-D positions)
    graph_pool = None  # what decode graphs index per sequence (decode_graphs.DecodeGraphs `states`)

    def route(self, backend):
        """The attention backend the feature's steps run on (an attn_backends backend)."""
        return backend

    def configure(self, config):
        """The engine's config as the feature allows it (an EngineConfig)."""
        return config

    def reset(self) -> None:
        """Forget every sequence (an engine reset)."""

    def has_room(self) -> bool:
        """Whether one more sequence may start running."""
        return True

    def fits(self, seq: Sequence) -> bool:
        """Whether `seq` may run beside the sequences running now (when not, admission tries another)."""
        return True

    def take(self, seq: Sequence) -> None:
        """An admitted `seq` starts running."""

    def release(self, seq: Sequence) -> None:
        """`seq` stops running (finish, abort, preemption)."""

    def on_void(self, seq: Sequence, recompute) -> None:
        """`seq`'s token of an overlapped step was corrected after the next step launched on it; `recompute`
        sends it back to be computed again from its tokens (Scheduler.recompute)."""

    def begin(self, items: list[tuple[Sequence, int]]) -> None:
        """Before a step's forward runs its (sequence, new tokens) pairs."""

    def commit(self, items: list[tuple[Sequence, int]]) -> None:
        """After the forward completed."""

    def plan(self, plan, prefill: list[tuple[Sequence, int]]) -> None:
        """Add what the attention backend needs to the step's StepPlan (step_plan.py), given its prefill chunks."""

    def inputs(self, ordered: list, input_ids: torch.Tensor, positions: torch.Tensor, embedding) -> dict:
        """The model's forward inputs for a packed row of `ordered` (sequence, new tokens) pairs."""
        return {"input_ids": input_ids[None], "position_ids": positions[None]}

    def packed(self, ordered: list[tuple[Sequence, int]], num_prefill: int) -> tuple[object, list[int]]:
        """What the forward needs of the packed row, and int rows to upload with the step (none here)."""
        return None, []

    def scope(self, step, flat: torch.Tensor, uploaded: slice):
        """A context for the forward, given `packed`'s first value and where its rows landed in `flat`."""
        return NO_SCOPE


class Features(StepFeature):
    """Several features where the scheduler takes one: each admission hook asks or tells them all."""

    def __init__(self, *features: StepFeature) -> None:
        self.features = features

    def has_room(self) -> bool:
        return all(f.has_room() for f in self.features)

    def fits(self, seq: Sequence) -> bool:
        return all(f.fits(seq) for f in self.features)

    def take(self, seq: Sequence) -> None:
        for f in self.features:
            f.take(seq)

    def release(self, seq: Sequence) -> None:
        for f in self.features:
            f.release(seq)


class SingleRank:
    """The rank group of a model on one process: the transport that carries nothing (tensor_parallel.RankGroup
    is the real one)."""

    rank = 0
    states = None  # RankGroup's: the state slots rank 0 sends each sequence's slot from

    def publish_config(self, config, max_model_len: int) -> None:
        """Nothing to tell: no other rank."""

    def agree_min(self, value: int) -> int:
        return value

    def step(self, batch: list, pending: torch.Tensor | None = None, graph: tuple[int, int] | None = None):
        return NO_SCOPE

    def close(self) -> None:
        """No other rank to stop."""


NO_FEATURE = StepFeature()
