"""A bounded latency sketch: log-spaced buckets with a fixed relative error (the DDSketch idea).

A batch of millions of requests must not store millions of latencies in its metrics state. Values go
into buckets whose edges grow by a factor `gamma`; any quantile comes back within `accuracy` relative
error, and the state holds at most a few hundred buckets from microseconds to hours.
"""

from __future__ import annotations

import math

MIN_VALUE = 1e-6  # values below this (1 µs) share one bucket


class LogHistogram:
    def __init__(self, accuracy: float = 0.01) -> None:
        if not 0 < accuracy < 1:
            raise ValueError(f"accuracy must be in (0, 1), got {accuracy!r}")
        self.accuracy = accuracy
        self.gamma = (1 + accuracy) / (1 - accuracy)
        self._log_gamma = math.log(self.gamma)
        self.buckets: dict[int, int] = {}
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, value: float, count: int = 1) -> None:
        key = self._key(value)
        self.buckets[key] = self.buckets.get(key, 0) + count
        self.count += count
        self.total += value * count
        self.max = max(self.max, value)

    def _key(self, value: float) -> int:
        return 0 if value <= MIN_VALUE else math.ceil(math.log(value / MIN_VALUE) / self._log_gamma)

    def _value(self, key: int) -> float:
        """The bucket's representative: within `accuracy` of every value in it."""
        if key == 0:
            return MIN_VALUE
        return MIN_VALUE * 2 * self.gamma**key / (self.gamma + 1)

    def quantile(self, q: float) -> float | None:
        if not self.count:
            return None
        rank = q * (self.count - 1)
        seen = 0
        for key in sorted(self.buckets):
            seen += self.buckets[key]
            if seen > rank:
                return min(self._value(key), self.max)
        return self.max

    def merge(self, other: LogHistogram) -> None:
        for key, n in other.buckets.items():
            self.buckets[key] = self.buckets.get(key, 0) + n
        self.count += other.count
        self.total += other.total
        self.max = max(self.max, other.max)

    def histogram(self, bins: int) -> tuple[list[int], list[float]]:
        """(counts, edges) over [0, max] in `bins` equal bins, from bucket representatives (for plots)."""
        if not self.count:
            return [], []
        top = self.max or MIN_VALUE
        width = top / bins
        counts = [0] * bins
        for key, n in self.buckets.items():
            counts[min(bins - 1, int(min(self._value(key), top) / width))] += n
        return counts, [i * width for i in range(bins + 1)]

    def to_state(self) -> dict:
        return {
            "accuracy": self.accuracy,
            "buckets": {str(k): v for k, v in self.buckets.items()},
            "count": self.count,
            "total": self.total,
            "max": self.max,
        }

    @classmethod
    def from_state(cls, state: dict) -> LogHistogram:
        sketch = cls(float(state["accuracy"]))
        sketch.buckets = {int(k): int(v) for k, v in state["buckets"].items()}
        sketch.count, sketch.total, sketch.max = (
            int(state["count"]),
            float(state["total"]),
            float(state["max"]),
        )
        return sketch
