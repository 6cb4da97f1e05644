"""A bounded, bucketed timeline of engine steps, for plotting throughput and occupancy over a run.

A batch of millions of requests runs millions of steps; keeping every step record would grow without
bound. Steps are summed into at most ``max_buckets`` equal-width time buckets; when the run outgrows
them, the width doubles and neighbouring buckets merge, so memory stays fixed and resolution degrades
gracefully. Records may arrive out of order across workers.
"""

from __future__ import annotations

import math

FIELDS = ("busy_s", "steps", "output_tokens", "prefill_tokens", "active_slot_s", "capacity_slot_s")
DEFAULT_MAX_BUCKETS = 1000


class Timeline:
    """Sums of step records per time bucket; ``points()`` turns them into rates for a plot."""

    def __init__(self, max_buckets: int = DEFAULT_MAX_BUCKETS, initial_width_s: float = 0.05) -> None:
        if max_buckets < 2 or max_buckets % 2:
            raise ValueError(f"max_buckets must be an even integer >= 2, got {max_buckets!r}")
        if not initial_width_s > 0:
            raise ValueError(f"initial_width_s must be > 0, got {initial_width_s!r}")
        self.max_buckets = max_buckets
        self.width_s = initial_width_s
        self.origin: float | None = None
        self.buckets: list[list[float]] = []

    def add(self, record: dict) -> None:
        """Add one engine step record ({"t": end time, "duration_s", "active_seqs", ...}).

        A step longer than a bucket (a big prefill) is spread over the buckets it covers, so the
        plot shows its work where it happened rather than as a spike at its end."""
        end = float(record["t"])
        duration = max(0.0, float(record.get("duration_s", 0.0)))
        start = end - duration
        first, last = self._make_room(start, end)
        capacity = record.get("max_num_seqs") or record.get("num_seqs") or 0
        active = record.get("active_seqs", record.get("num_seqs", 0))
        # A step produces one token per decoding sequence, plus one for each prompt it completes;
        # the record only counts decode tokens, so this slightly undercounts prefill-heavy steps.
        amounts = (
            duration,
            0,
            record.get("decode_tokens", 0),
            record.get("prefill_tokens", 0),
            active * duration,
            capacity * duration,
        )
        for index in range(first, last + 1):
            if first == last:
                share = 1.0
            else:
                low = max(start, self.origin + index * self.width_s)
                high = min(end, self.origin + (index + 1) * self.width_s)
                share = max(0.0, high - low) / duration
            bucket = self.buckets[index]
            for i, amount in enumerate(amounts):
                bucket[i] += amount * share
        self.buckets[last][1] += 1  # the step is counted where it ends

    def _make_room(self, start: float, end: float) -> tuple[int, int]:
        """Extend or coarsen so [start, end] fits; return the first and last bucket it touches."""
        if self.origin is None:
            self.origin = start
        if start < self.origin:
            self._extend_left(start)
        while self._span(start, end)[1] >= self.max_buckets:
            self._coarsen()
        first, last = self._span(start, end)
        while len(self.buckets) <= last:
            self.buckets.append([0.0] * len(FIELDS))
        return first, last

    def _span(self, start: float, end: float) -> tuple[int, int]:
        first = int((start - self.origin) // self.width_s)
        return first, max(first, math.ceil((end - self.origin) / self.width_s) - 1)

    def _coarsen(self) -> None:
        self.width_s *= 2
        merged = []
        for i in range(0, len(self.buckets), 2):
            pair = self.buckets[i : i + 2]
            merged.append([sum(col) for col in zip(*pair, strict=True)])
        self.buckets = merged

    def _extend_left(self, t: float) -> None:
        shift = math.ceil((self.origin - t) / self.width_s)
        while len(self.buckets) + shift > self.max_buckets:
            if len(self.buckets) % 2:
                self.buckets.append([0.0] * len(FIELDS))
            self._coarsen()
            shift = math.ceil((self.origin - t) / self.width_s)
        self.origin -= shift * self.width_s
        self.buckets[:0] = [[0.0] * len(FIELDS) for _ in range(shift)]

    def points(self) -> list[dict]:
        """One point per bucket (idle ones too): time since the first step began, tokens/s, occupancy."""
        out = []
        for i, bucket in enumerate(self.buckets):
            row = dict(zip(FIELDS, bucket, strict=True))
            out.append(
                {
                    "t_s": round(i * self.width_s, 6),
                    "width_s": self.width_s,
                    "steps": round(row["steps"]),
                    "output_tokens_per_s": row["output_tokens"] / self.width_s,
                    "busy_workers": row["busy_s"] / self.width_s,
                    "occupancy": row["active_slot_s"] / row["capacity_slot_s"]
                    if row["capacity_slot_s"]
                    else 0.0,
                }
            )
        return out

    def to_state(self) -> dict:
        return {
            "max_buckets": self.max_buckets,
            "width_s": self.width_s,
            "origin": self.origin,
            "buckets": self.buckets,
        }

    @classmethod
    def from_state(cls, state: dict) -> Timeline:
        timeline = cls(int(state["max_buckets"]), float(state["width_s"]))
        timeline.origin = state["origin"]
        timeline.buckets = [[float(v) for v in bucket] for bucket in state["buckets"]]
        return timeline
