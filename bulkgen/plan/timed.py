"""The engine's continuous batching replayed on paper, with a measured cost per step: a file -> seconds.

Follows the engine's scheduler (bulkgen/engine/scheduler.py) closely enough to time it: every step first
decodes one token for each running sequence whose prompt is done, then continues unfinished prompts, then
admits waiting requests (longest first, as the workers pull ranges and the engine admits them) while
slots and the step's token budget allow; a prompt longer than the budget is prefilled in chunks. A
sequence whose prompt completes samples its first token in that step. KV-cache pressure (preemption) is
not modelled: on CPU the cache holds every slot at full length, on a GPU it is sized for the step limits.

The context a step's decodes attend to is counted as the engine's decode attention reads it
(`attended`): whole KV blocks, and, where the decode path pads (the CPU path: one SDPA call over every
decoding sequence padded to the longest one's blocks), the longest sequence's blocks for each of them.
A file of short chat prompts decodes ragged sequences (the longest about twice the mean), so counting
the sum there put its decode steps 10-25% under the engine's.

Step cost is linear (see bulkgen/plan/profile.py), so runs of pure decode steps, where nothing can be
admitted, are jumped over in one go: the simulation costs a few operations per request, not per token.
Several workers: ranges of `range_size` requests are dealt longest first to the least loaded worker (as
idle workers pull the longest range left); the batch ends when the last worker does.

A vision model's encoder runs inside the step whose prefill reaches a request's images, once for all of
that step's new images (bulkgen.engine.features.multimodal.splice): each request may carry its encoder seconds
(`Encoder`), added to the step that admits it, with one call's fixed cost per step that encodes any.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

# (sequences in the step, prefill tokens, context tokens, sequences admitted in it) -> seconds
StepCost = Callable[[int, int, int, int], float]
Request = tuple[int, int, float]  # (prompt tokens to compute, output tokens, encoder seconds)


@dataclass
class _Seq:
    prefill_left: int
    decode_left: int
    context: int


@dataclass(frozen=True)
class Encoder:
    """A vision encoder's work: seconds per request (0 for one without images, or whose images the prefix
    cache holds) and the fixed cost of one encoder call, paid by each step that encodes."""

    seconds: Sequence[float]
    call_s: float = 0.0


@dataclass(frozen=True)
class EngineLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 1  # KV block size: decode attention reads whole blocks
    decode_padded: bool = False  # decodes attend over the longest decoding sequence's blocks, each


def attended(lengths: Sequence[int], block_size: int = 1, padded: bool = False) -> int:
    """Context tokens the decode attention of one step reads, for decoding sequences of `lengths` tokens
    (the new token's included): each one's blocks, or, `padded`, the longest one's blocks for each."""
    if not lengths:
        return 0
    if padded:
        return len(lengths) * -(-max(lengths) // block_size) * block_size
    return sum(-(-n // block_size) * block_size for n in lengths)


def batch_seconds(
    prompts: Sequence[int] | np.ndarray,
    outputs: Sequence[int] | np.ndarray,
    cost: StepCost,
    limits: EngineLimits,
    workers: int = 1,
    range_size: int = 32,
    encoder: Encoder | None = None,
) -> float:
    """Wall seconds from the first request entering an engine to the last one finishing.
    `prompts`: prompt tokens each request must compute (cached prefix excluded); `outputs`: tokens each
    generates (>= 1; 0 for a prefill-only request such as an embedding); `encoder`: a vision model's.
    The requests stay in arrays (a few machine words each: `bulkgen plan` of 10M lines holds them all), and
    only the sequences an engine runs at once are objects."""
    prompts, outputs = np.asarray(prompts), np.asarray(outputs)
    seconds = None if encoder is None else np.asarray(encoder.seconds, np.float64)
    if len(outputs) != len(prompts) or (seconds is not None and len(seconds) != len(prompts)):
        raise ValueError("prompts, outputs and the encoder's seconds must be one entry per request")
    loads = _deal(prompts + outputs, max(1, workers), range_size)
    call_s = encoder.call_s if encoder is not None else 0.0
    return max(
        (
            engine_seconds(
                _Waiting(prompts[load], outputs[load], None if seconds is None else seconds[load]),
                cost,
                limits,
                call_s,
            )
            for load in loads
            if len(load)
        ),
        default=0.0,
    )


def _deal(work: np.ndarray, workers: int, range_size: int) -> list[np.ndarray]:
    """Each worker's requests (indices): ranges of `range_size` in file order, dealt heaviest first (by
    mean work a request) to the least loaded worker, the lowest-numbered on a tie."""
    starts = np.arange(0, len(work), range_size)
    if not len(starts):
        return [np.zeros(0, np.int64) for _ in range(workers)]
    sums = np.add.reduceat(work, starts)
    sizes = np.diff(np.append(starts, len(work)))
    order = np.argsort(-(sums / sizes), kind="stable")  # heaviest first; ties keep file order
    heap = [(0, w) for w in range(workers)]  # (work dealt, worker): the least, then the lowest number
    owner = np.empty(len(starts), np.int64)
    for r, total in zip(order.tolist(), sums[order].tolist(), strict=True):
        dealt, w = heapq.heappop(heap)
        owner[r] = w
        heapq.heappush(heap, (dealt + total, w))
    loads = []
    for w in range(workers):
        ranges = order[owner[order] == w]  # in the order they were dealt
        parts = [np.arange(starts[r], starts[r] + sizes[r]) for r in ranges.tolist()]
        loads.append(np.concatenate(parts) if parts else np.zeros(0, np.int64))
    return loads


class _Waiting:
    """One engine's requests not yet admitted, longest (prompt + output) first, popped off the end."""

    def __init__(self, prompts: np.ndarray, outputs: np.ndarray, seconds: np.ndarray | None) -> None:
        order = np.argsort(prompts + outputs, kind="stable")  # the next to admit is last
        self.prompts, self.outputs = prompts[order], outputs[order]
        self.seconds = None if seconds is None else seconds[order]
        self.left = len(order)

    def __bool__(self) -> bool:
        return self.left > 0

    def pop(self) -> Request:
        self.left -= 1
        i = self.left
        encoder_s = 0.0 if self.seconds is None else float(self.seconds[i])
        return self.prompts[i].item(), self.outputs[i].item(), encoder_s


def engine_seconds(
    waiting: _Waiting, cost: StepCost, limits: EngineLimits, encoder_call_s: float = 0.0
) -> float:
    """One engine's time for its `waiting` requests, admitted longest first."""
    running: list[_Seq] = []
    seconds = 0.0
    while waiting or running:
        decoding = [s for s in running if not s.prefill_left]
        if (
            not waiting
            and all(not s.prefill_left for s in running)
            or (len(running) >= limits.max_num_seqs and decoding == running)
        ):
            seconds += _decode_run(running, cost, limits)
        else:
            seconds += _mixed_step(running, waiting, cost, limits, encoder_call_s)
        running = [s for s in running if s.prefill_left or s.decode_left]
    return seconds


def _decode_run(running: list[_Seq], cost: StepCost, limits: EngineLimits) -> float:
    """Steps until the first running sequence ends, all pure decode: summed in closed form (linear cost;
    the blocks' rounding taken at its mean over the run, half a block a sequence)."""
    k, n = min(s.decode_left for s in running), len(running)
    context = attended([s.context + 1 for s in running], 1, limits.decode_padded)
    context += n * (limits.block_size - 1) // 2
    first = cost(n, 0, context, 0)
    per_step_growth = cost(n, 0, context + n, 0) - first  # the context grows by n tokens a step
    for s in running:
        s.decode_left -= k
        s.context += k
    return k * first + per_step_growth * k * (k - 1) / 2


def _mixed_step(
    running: list[_Seq],
    waiting: _Waiting,
    cost: StepCost,
    limits: EngineLimits,
    encoder_call_s: float = 0.0,
) -> float:
    budget, prefill, active, admitted, encoding = limits.max_num_batched_tokens, 0, 0, 0, 0.0
    decoding: list[int] = []
    for s in sorted(running, key=lambda s: bool(s.prefill_left)):  # decodes first
        if budget == 0:
            break
        active += 1
        if not s.prefill_left:
            decoding.append(s.context + 1)
            s.decode_left, s.context, budget = s.decode_left - 1, s.context + 1, budget - 1
            continue
        n = min(s.prefill_left, budget)
        s.prefill_left, s.context, budget, prefill = (
            s.prefill_left - n,
            s.context + n,
            budget - n,
            prefill + n,
        )
        if not s.prefill_left:
            s.decode_left = max(0, s.decode_left - 1)  # the step that ends a prompt samples its first token
    while waiting and budget > 0 and len(running) < limits.max_num_seqs:
        prompt, output, encoder_s = waiting.pop()
        encoding += encoder_s
        n = min(max(prompt, 1), budget)
        seq = _Seq(max(prompt, 1) - n, output, n)
        if not seq.prefill_left and output:
            seq.decode_left -= 1
        running.append(seq)
        active, budget, prefill, admitted = active + 1, budget - n, prefill + n, admitted + 1
    step = cost(active, prefill, attended(decoding, limits.block_size, limits.decode_padded), admitted)
    return step + (encoding + encoder_call_s if encoding else 0.0)
