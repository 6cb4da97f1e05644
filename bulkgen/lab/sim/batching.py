"""A discrete-step model of static, dynamic and continuous batching.

The point is to let a user see, on numbers they can check by hand, why continuous batching wins:
one step produces one token for every active sequence, and every sequence holding a slot costs one
slot-step, whether it still produces tokens or only waits for the rest of its group (padding).

Conventions (all steps are integers):
- A request that arrives at step ``a`` can produce its first token in step ``a`` (steps are numbered
  from 0); a request that starts at ``s`` with ``L`` tokens produces its last one in step ``s + L - 1``
  and its *finish step* is ``s + L`` (the number of steps elapsed when it is done). ``makespan`` is the
  largest finish step.
- static: fixed groups of ``max_batch`` in arrival order; a group starts when the previous group has
  ended and its last member has arrived; every member holds its slot until the group's longest member
  is done, and that is every member's finish step.
- dynamic: whenever the engine is idle, a group starts as soon as ``max_batch`` requests wait or the
  oldest waiting one has waited ``max_wait`` steps; the group takes up to ``max_batch`` waiting
  requests and then runs like a static group. It does not know whether more requests will come.
- continuous: before each step, free slots are filled from the queue in arrival order (only requests
  that have arrived); a sequence frees its slot right after its last token.
- Prefill (``prompt_lengths``): static and dynamic pad every group's prompts to its longest prompt;
  continuous packs prompts (iteration-level scheduling, as Orca and vLLM do), so nothing is padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

POLICIES = ("static", "dynamic", "continuous")
DEFAULT_MAX_WAIT = 4


class SimulationInputError(ValueError):
    """Bad simulator input; ``field`` names the argument (e.g. "lengths"), the message its bad value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


@dataclass(frozen=True)
class Workload:
    """Requests r0..r(n-1) in arrival order: output lengths, arrival steps, optional prompt lengths."""

    lengths: tuple[int, ...]
    arrivals: tuple[int, ...] = ()
    prompt_lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.lengths:
            raise SimulationInputError("lengths", "need at least one request")
        _check_ints("lengths", self.lengths, minimum=1)
        if not self.arrivals:
            object.__setattr__(self, "arrivals", (0,) * len(self.lengths))
        _check_same_count("arrivals", self.arrivals, len(self.lengths))
        _check_ints("arrivals", self.arrivals, minimum=0)
        for i in range(1, len(self.arrivals)):
            if self.arrivals[i] < self.arrivals[i - 1]:
                raise SimulationInputError(
                    "arrivals",
                    f"must be in request order (non-decreasing): r{i} arrives at "
                    f"{self.arrivals[i]}, before r{i - 1} at {self.arrivals[i - 1]}",
                )
        if self.prompt_lengths is not None:
            _check_same_count("prompt_lengths", self.prompt_lengths, len(self.lengths))
            _check_ints("prompt_lengths", self.prompt_lengths, minimum=1)

    def __len__(self) -> int:
        return len(self.lengths)


def _check_ints(name: str, values: Sequence[int], minimum: int) -> None:
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise SimulationInputError(name, f"r{i} is {value!r}; each must be an integer >= {minimum}")


def _check_same_count(name: str, values: Sequence[int], count: int) -> None:
    if len(values) != count:
        raise SimulationInputError(name, f"got {len(values)} values for {count} requests (one per length)")


@dataclass(frozen=True)
class Segment:
    """One request's stay in one slot: tokens in steps [start, done), slot held until ``release``."""

    request: int
    slot: int
    start: int
    done: int
    release: int

    @property
    def slot_steps(self) -> int:
        return self.release - self.start


@dataclass
class SimResult:
    """What a policy did with a workload: every slot's history plus the groups it launched."""

    policy: str
    max_batch: int
    workload: Workload
    segments: list[Segment]
    groups: list[list[int]] = field(default_factory=list)

    @property
    def makespan(self) -> int:
        return max(seg.release for seg in self.segments)

    def finish_steps(self) -> dict[str, int]:
        by_request = sorted(self.segments, key=lambda seg: seg.request)
        return {f"r{seg.request}": seg.release for seg in by_request}

    def metrics(self) -> dict:
        """The measures the field uses, JSON-able; percentages are on a 0-100 scale."""
        makespan = self.makespan
        slot_steps = sum(seg.slot_steps for seg in self.segments)
        useful = sum(self.workload.lengths)
        wasted = slot_steps - useful
        out = {
            "policy": self.policy,
            "max_batch": self.max_batch,
            "requests": len(self.workload),
            "makespan": makespan,
            "slot_steps": slot_steps,
            "useful_tokens": useful,
            "wasted_slot_steps": wasted,
            "waste_pct": _pct(wasted, slot_steps),
            "useful_tokens_per_step": round(useful / makespan, 4),
            "raw_occupancy": round(slot_steps / (makespan * self.max_batch), 4),
            "slot_efficiency": round(useful / slot_steps, 4),
            "finish_steps": self.finish_steps(),
        }
        if self.workload.prompt_lengths is not None:
            out.update(self._prefill_metrics())
        return out

    def _prefill_metrics(self) -> dict:
        prompts = self.workload.prompt_lengths or ()
        useful = sum(prompts)
        if self.policy == "continuous":
            slots = useful
        else:
            slots = sum(len(group) * max(prompts[r] for r in group) for group in self.groups)
        return {
            "prefill_slots": slots,
            "prefill_useful": useful,
            "prefill_waste_pct": _pct(slots - useful, slots),
        }


def _pct(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 2) if whole else 0.0


def simulate(workload: Workload, policy: str, max_batch: int, max_wait: int = DEFAULT_MAX_WAIT) -> SimResult:
    """Run one policy over the workload and return every slot's history."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise SimulationInputError("max_batch", f"must be an integer >= 1, got {max_batch!r}")
    if isinstance(max_wait, bool) or not isinstance(max_wait, int) or max_wait < 0:
        raise SimulationInputError("max_wait", f"must be an integer >= 0 steps, got {max_wait!r}")
    if policy == "continuous":
        return SimResult(policy, max_batch, workload, _continuous(workload, max_batch))
    if policy == "static":
        groups = _static_groups(workload, max_batch)
    elif policy == "dynamic":
        groups = _dynamic_groups(workload, max_batch, max_wait)
    else:
        raise SimulationInputError("policy", f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    segments = _run_groups(workload, groups)
    return SimResult(policy, max_batch, workload, segments, [members for _, members in groups])


def _static_groups(workload: Workload, max_batch: int) -> list[tuple[int, list[int]]]:
    """Fixed groups in arrival order; a group waits for its last member and for the previous group."""
    groups, free_at = [], 0
    for first in range(0, len(workload), max_batch):
        members = list(range(first, min(first + max_batch, len(workload))))
        start = max(free_at, workload.arrivals[members[-1]])
        groups.append((start, members))
        free_at = start + max(workload.lengths[r] for r in members)
    return groups


def _dynamic_groups(workload: Workload, max_batch: int, max_wait: int) -> list[tuple[int, list[int]]]:
    """Launch a group when the batch is full or the oldest waiting request has waited max_wait."""
    arrivals, groups = workload.arrivals, []
    now, nxt = 0, 0  # nxt: first request not yet in a group
    while nxt < len(workload):
        now = max(now, arrivals[nxt])
        arrived = sum(1 for a in arrivals[nxt : nxt + max_batch] if a <= now)
        if arrived < max_batch and now < arrivals[nxt] + max_wait:
            pending = nxt + arrived
            next_arrival = arrivals[pending] if pending < len(workload) else None
            deadline = arrivals[nxt] + max_wait
            now = deadline if next_arrival is None else min(deadline, next_arrival)
            continue
        members = list(range(nxt, nxt + arrived))
        groups.append((now, members))
        now += max(workload.lengths[r] for r in members)
        nxt += arrived
    return groups


def _run_groups(workload: Workload, groups: list[tuple[int, list[int]]]) -> list[Segment]:
    segments = []
    for start, members in groups:
        end = start + max(workload.lengths[r] for r in members)
        for slot, r in enumerate(members):
            segments.append(Segment(r, slot, start, start + workload.lengths[r], end))
    return segments


def _continuous(workload: Workload, max_batch: int) -> list[Segment]:
    """Fill free slots before every step; idle steps are skipped to the next arrival."""
    free_at = [0] * max_batch  # step from which each slot is free
    segments = []
    for r, (length, arrival) in enumerate(zip(workload.lengths, workload.arrivals, strict=True)):
        slot = min(range(max_batch), key=lambda s: (max(free_at[s], arrival), s))
        start = max(free_at[slot], arrival)
        segments.append(Segment(r, slot, start, start + length, start + length))
        free_at[slot] = start + length
    return segments
