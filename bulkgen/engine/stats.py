"""Per-step records and cumulative counters: how full the slots were and how much work was useful."""

from __future__ import annotations

import time

from bulkgen.engine.scheduler import ScheduledBatch
from bulkgen.engine.sequence import Sequence
from bulkgen.engine.sketch import LogHistogram


class EngineStats:
    """Cumulative, JSON-able counters plus the per-step records the worker drains."""

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.counters = dict(
            steps=0,
            busy_time_s=0.0,
            slot_steps=0,
            active_slot_steps=0,
            useful_tokens=0,
            prefill_tokens=0,
            decode_tokens=0,
            output_tokens=0,
            cached_prompt_tokens=0,
            padding_slot_steps=0,
            discarded_tokens=0,
        )
        self.histogram: dict[str, int] = {}
        self.records: list[dict] = []

    def record_step(
        self, batch: ScheduledBatch, duration_s: float, sampled: list[Sequence], discarded: int = 0
    ) -> None:
        """`discarded`: items computed in vain (with overlapped steps: sequences that had ended, or whose
        input token was corrected, by the time the host read the step before); not useful tokens."""
        output_tokens = len(sampled)
        c = self.counters
        c["steps"] += 1
        c["busy_time_s"] += duration_s
        c["slot_steps"] += batch.held_slots
        c["active_slot_steps"] += len(batch.items)
        c["useful_tokens"] += batch.prefill_tokens + batch.decode_tokens - discarded
        c["discarded_tokens"] += discarded
        c["prefill_tokens"] += batch.prefill_tokens
        c["decode_tokens"] += batch.decode_tokens
        c["output_tokens"] += output_tokens
        c["padding_slot_steps"] += batch.padding_slots
        key = str(batch.held_slots)
        self.histogram[key] = self.histogram.get(key, 0) + 1
        self.records.append(
            dict(
                t=time.time(),
                duration_s=duration_s,
                num_seqs=batch.held_slots,
                active_seqs=len(batch.items),
                prefill_tokens=batch.prefill_tokens,
                decode_tokens=batch.decode_tokens,
                padding_slots=batch.padding_slots,
                max_num_seqs=self.max_num_seqs,
                by_tag=by_tag(batch, sampled),
            )
        )

    def add_cached(self, num_tokens: int) -> None:
        self.counters["cached_prompt_tokens"] += num_tokens

    def snapshot(self, preemptions: int, prefill_padding_tokens: int) -> dict:
        """slot_efficiency: share of held slot-steps that computed a token (1.0 for continuous batching);
        useful_tokens_per_slot_step counts prefill tokens too, so it can exceed 1."""
        c = dict(self.counters)
        slot_steps = c["slot_steps"]
        c.update(
            preemptions=preemptions,
            prefill_padding_tokens=prefill_padding_tokens,
            batch_size_histogram=dict(self.histogram),
            slot_efficiency=c["active_slot_steps"] / slot_steps if slot_steps else 0.0,
            useful_tokens_per_slot_step=c["useful_tokens"] / slot_steps if slot_steps else 0.0,
            tokens_per_s=c["output_tokens"] / c["busy_time_s"] if c["busy_time_s"] else 0.0,
        )
        return c

    def pop_records(self) -> list[dict]:
        records, self.records = self.records, []
        return records


class StepTimes:
    """Wall time of engine steps, bounded (a log-bucketed sketch, 1% relative error): what a worker reports
    of its engine so operators and benches can compare a step in the worker with a step alone."""

    def __init__(self) -> None:
        self._sketch = LogHistogram()

    def add(self, duration_s: float) -> None:
        self._sketch.add(max(0.0, float(duration_s)))

    def summary(self) -> dict:
        """steps, and mean / p50 / p90 step wall time in ms (None before the first step)."""
        sketch = self._sketch

        def ms(value: float | None) -> float | None:
            return None if value is None else round(1000.0 * value, 3)

        return {
            "steps": sketch.count,
            "mean_ms": ms(sketch.total / sketch.count if sketch.count else None),
            "p50_ms": ms(sketch.quantile(0.5)),
            "p90_ms": ms(sketch.quantile(0.9)),
        }


def by_tag(batch: ScheduledBatch, sampled: list[Sequence]) -> dict[str, dict[str, int]]:
    """Per-tag share of one step (host-side counting over the step's sequences; untagged under "")."""
    tags: dict[str, dict[str, int]] = {}

    def entry(seq: Sequence) -> dict[str, int]:
        tag = seq.request.tag
        if tag not in tags:
            tags[tag] = dict(held=0, active=0, prefill_tokens=0, decode_tokens=0, output_tokens=0)
        return tags[tag]

    for seq in batch.held:
        entry(seq)["held"] += 1
    for (seq, n), is_decode in zip(batch.items, batch.is_decode, strict=True):
        counts = entry(seq)
        counts["active"] += 1
        counts["decode_tokens" if is_decode else "prefill_tokens"] += n
    for seq in sampled:
        entry(seq)["output_tokens"] += 1
    return tags
