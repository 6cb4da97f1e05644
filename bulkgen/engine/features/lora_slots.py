"""Mixed LoRA adapters in one packed step: a fixed pool of device slots and the linear layers that read them.

Every linear layer some adapter targets is wrapped once (LoraLinear) with two slot-stacked buffers,
A [max_loras, max_rank, in] and B [max_loras, out, max_rank] (B already scaled); an adapter of rank r
fills the first r rows / columns of its slot, so adapters of different ranks share a step. The base
GEMM runs once over the whole packed row; then each segment of rows of one adapter is shrunk (x Aᵀ, r
columns) and expanded (· Bᵀ) into the output in place, one matmul and one addmm: vLLM's torch punica
reference (`sgmv_shrink` / `sgmv_expand` over segments). The runner sorts a step's prefill chunks and
its decodes by adapter, so an adapter has at most two segments (host ints: nothing to upload). Base rows
are in no segment and pay nothing; a step without adapters runs the plain layer.

Slots are filled (`activate`) when a step is scheduled, before its forward launches, from the host
cache (lora.LoraAdapter), least recently used slot first among those the step does not use. The
scheduler admits sequences of at most `max_loras` distinct adapters at once (AdapterRows, the scheduler's
step feature: step_features.py), so a step's adapters always fit.
On CUDA the host copies are kept pinned in the model's dtype, so a load is queued on the stream (behind
the step in flight, ahead of the one about to launch) without the host waiting for it. Not run on a GPU
yet. Decode CUDA graphs hold no LoRA ops: a decode step with adapter rows runs eagerly (model_runner).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager

import torch

from bulkgen.engine.features.lora import LoraAdapter, LoraError, LoraWrapper
from bulkgen.engine.sequence import Sequence
from bulkgen.engine.step_features import StepFeature


class LoraLinear(LoraWrapper):
    """A linear layer plus the LoRA slots of its module; the base layer's output when no step is active."""

    def __init__(self, base: torch.nn.Linear, pool: LoraSlots, reduce=None) -> None:
        super().__init__()
        self.base = base
        self.pool = pool  # not a submodule: the pool owns every wrapped layer
        self.reduce = reduce  # a row-parallel layer's all-reduce of the shrink (lora_tp.py); None: whole
        w = base.weight
        self.register_buffer("lora_a", w.new_zeros(pool.max_loras, pool.max_rank, base.in_features))
        self.register_buffer("lora_b", w.new_zeros(pool.max_loras, base.out_features, pool.max_rank))
        # per slot, (Aᵀ, Bᵀ) views of its loaded rank, made once per load (a step reads them per segment);
        # None when the slot's adapter leaves this layer alone
        self.views: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * pool.max_loras

    @property
    def weight(self) -> torch.Tensor:  # code that reads a linear's weight (dtype, device) still finds it
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        segments = self.pool.step
        if not segments:
            return out
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if flat_x.shape[0] != self.pool.num_tokens:  # segments index the packed row: never guess on another
            raise RuntimeError(
                f"a LoRA layer was called on {flat_x.shape[0]} rows in a step of {self.pool.num_tokens} tokens"
            )
        if self.reduce is not None:
            self._row_parallel(flat_x, flat_out, segments)
            return out
        views = self.views
        for slot, start, end in segments:
            pair = views[slot]
            if pair is not None:
                flat_out[start:end].addmm_(flat_x[start:end] @ pair[0], pair[1])
        return out

    def _row_parallel(self, flat_x: torch.Tensor, flat_out: torch.Tensor, segments: list) -> None:
        """A row-parallel layer: every segment's partial shrink (this rank's input columns) summed over
        the ranks in one collective, then expanded into the base's all-reduced output (lora_tp.py)."""
        live = [(self.views[slot], s, e) for slot, s, e in segments if self.views[slot] is not None]
        parts = [(flat_x[s:e] @ pair[0], s, e, pair[1]) for pair, s, e in live]
        if not parts:
            return
        packed = self.reduce(torch.cat([shrink.reshape(-1) for shrink, *_ in parts]))
        at = 0
        for shrink, start, end, b in parts:
            flat_out[start:end].addmm_(packed[at : at + shrink.numel()].view_as(shrink), b)
            at += shrink.numel()

    def load(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Copy an adapter's (A, B·scale) into `slot` (None: the adapter leaves this layer alone)."""
        if pair is None:
            self.views[slot] = None
            return
        a, b = pair
        r = a.shape[0]
        self.lora_a[slot, :r].copy_(a, non_blocking=True)
        self.lora_b[slot, :, :r].copy_(b, non_blocking=True)
        self.views[slot] = (self.lora_a[slot, :r].T, self.lora_b[slot, :, :r].T)


class LoraSlots:
    """The host cache of adapters (by name) and the `max_loras` device slots they are loaded into."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.adapters: dict[str, LoraAdapter] = {}
        self.layers: dict[str, LoraLinear] = {}  # wrapped module path -> its layer
        self.resident: OrderedDict[int, int] = OrderedDict()  # adapter uid -> slot, least recent first
        self.step: list[tuple[int, int, int]] | None = None  # (slot, first row, end) while a forward runs
        self.num_tokens = 0  # the packed row's length in the step running
        self.loads = 0  # slot loads so far (a test reads it: LRU reuse)
        self.published: set[int] = set()  # tensor-parallel rank 0: uids whose folder followers can read
        self.tp = getattr(model, "bulkgen_tp", None)  # tensor_parallel.RankGroup: it splits and reduces LoRA
        if (
            self.tp is not None
        ):  # its step plans carry these slots (rank 0) or fill them (followers): lora_tp.py
            self.tp.loras = self

    def add(self, adapter: LoraAdapter) -> None:
        """Cache `adapter` on the host and wrap the layers it targets (each layer is wrapped once)."""
        if adapter.name in self.adapters:
            raise LoraError(f"adapter {adapter.name!r} is already loaded; remove it first")
        for module in adapter.weights:
            if module not in self.layers:
                parent, _, child = module.rpartition(".")
                owner = self.model.get_submodule(parent)
                reduce = tp.lora_reduce(self.model, module) if (tp := self.tp) is not None else None
                self.layers[module] = LoraLinear(getattr(owner, child), self, reduce)
                setattr(owner, child, self.layers[module])
        weight = next(self.model.parameters())
        if weight.device.type == "cuda":  # in the slots' dtype and pinned: a slot load is an async copy
            adapter.weights = {
                m: (a.to(weight.dtype).pin_memory(), b.to(weight.dtype).pin_memory())
                for m, (a, b) in adapter.weights.items()
            }
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> LoraAdapter:
        adapter = self.get(name)
        del self.adapters[name]
        self.resident.pop(adapter.uid, None)  # its slot is reused first: no longer in the LRU order
        return adapter

    def get(self, name: str) -> LoraAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise LoraError(f"unknown LoRA adapter {name!r}; loaded: {sorted(self.adapters) or 'none'}")
        return adapter

    def prepare(self, items: list) -> None:
        """Fill the slots of the adapters of a step's (sequence, new tokens) pairs before its forward is
        launched (and, under tensor parallel, before the plan that names the slots is posted), never inside it."""
        adapters = {seq.lora for seq, _ in items if seq.lora is not None}
        if adapters:
            self.activate(adapters)

    def activate(self, adapters: set[LoraAdapter]) -> dict[int, int]:
        """Slots for `adapters` (at most max_loras: the scheduler's rule), loading those not resident into
        free or least recently used slots; {uid: slot}."""
        for adapter in adapters:
            if adapter.uid in self.resident:
                self.resident.move_to_end(adapter.uid)
        wanted = {a.uid for a in adapters}
        for adapter in adapters:
            if adapter.uid not in self.resident:
                self._load(adapter, self._free_slot(wanted))
        return {uid: self.resident[uid] for uid in wanted}

    def _free_slot(self, wanted: set[int]) -> int:
        taken = set(self.resident.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            return free[0]
        victim = next((uid for uid in self.resident if uid not in wanted), None)
        if victim is None:  # the scheduler's rule was broken: never load over a slot this step reads
            raise LoraError(f"a step uses more than max_loras ({self.max_loras}) adapters")
        return self.resident.pop(victim)

    def place(self, assignment: dict[int, int]) -> None:
        """A tensor-parallel follower: exactly rank 0's {uid: slot}, loading what moved (lora_tp.follow)."""
        by_uid = {a.uid: a for a in self.adapters.values()}
        for uid in [u for u, slot in self.resident.items() if assignment.get(u) != slot]:
            del self.resident[uid]
        for uid, slot in assignment.items():
            if uid not in self.resident:
                self._load(by_uid[uid], slot)

    def _load(self, adapter: LoraAdapter, slot: int) -> None:
        for module, layer in self.layers.items():
            layer.load(slot, adapter.weights.get(module))
        self.resident[adapter.uid] = slot
        self.loads += 1

    def order(self, rows: list) -> None:
        """Sort a part of a step's (sequence, new tokens) rows by adapter when any has one, so each adapter's
        rows are one segment (the base model's first)."""
        if self.resident and any(seq.lora is not None for seq, _ in rows):
            rows.sort(key=_adapter_uid)

    def segments(self, ordered: list) -> list[tuple[int, int, int]]:
        """(slot, first row, end) of each run of packed rows of one adapter; the slots were filled when the
        step was scheduled (activate)."""
        out: list[tuple[int, int, int]] = []
        if not self.resident:  # no adapter was ever used: no row has one
            return out
        q_off, resident = 0, self.resident
        for seq, n in ordered:
            if seq.lora is not None:
                slot = resident[seq.lora.uid]
                if out and out[-1][0] == slot and out[-1][2] == q_off:
                    out[-1] = (slot, out[-1][1], q_off + n)
                else:
                    out.append((slot, q_off, q_off + n))
            q_off += n
        return out

    @contextmanager
    def scope(self, ordered: list, num_tokens: int):
        """The wrapped layers add the deltas of the adapters of the packed row of `ordered` (sequence, new
        tokens) pairs inside the block (the engine's forward only)."""
        self.step, self.num_tokens = self.segments(ordered), num_tokens
        try:
            yield
        finally:
            self.step = None


def _adapter_uid(item: tuple) -> int:
    return 0 if item[0].lora is None else item[0].lora.uid


class AdapterRows(StepFeature):
    """The scheduler's side of LoRA: a step holds rows of at most `max_loras` distinct adapters (the device
    slots), so a sequence of another adapter waits while sequences of running adapters (or the base model)
    go ahead."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.running: dict[int, set[int]] = {}  # adapter uid -> ids of its running sequences

    def fits(self, seq: Sequence) -> bool:
        lora = seq.lora
        return lora is None or lora.uid in self.running or len(self.running) < self.max_loras

    def take(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.running.setdefault(seq.lora.uid, set()).add(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        """Idempotent: a sequence preempted, then finished, is released twice."""
        held = self.running.get(seq.lora.uid) if seq.lora is not None else None
        if held is not None:
            held.discard(seq.seq_id)
            if not held:
                del self.running[seq.lora.uid]
