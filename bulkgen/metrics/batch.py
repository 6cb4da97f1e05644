"""Metrics of one real batch: throughput, slot efficiency, padding waste and latency percentiles.

The runner feeds it finished requests (``RequestMetrics.as_dict()``), workers' step records and their
cumulative engine stats; ``summary()`` is what the batch object, ``bulkgen status --metrics`` and the
stored report show. Memory stays bounded for millions of requests: latencies are kept as packed
float arrays (8 bytes each) for exact percentiles, and the timeline is bucketed (see ``Timeline``).
``to_state()``/``from_state()`` let a runner persist it beside the result parts and resume.
"""

from __future__ import annotations

import math
from array import array

import numpy as np

from bulkgen.metrics.timeline import DEFAULT_MAX_BUCKETS, Timeline

LATENCY_KEYS = ("ttft_s", "tpot_s", "queue_wait_s")
TOKEN_KEYS = ("num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "num_preemptions")
SUMMED_STATS = (
    "steps",
    "busy_time_s",
    "slot_steps",
    "useful_tokens",
    "prefill_tokens",
    "decode_tokens",
    "output_tokens",
    "cached_prompt_tokens",
    "padding_slot_steps",
    "prefill_padding_tokens",
    "preemptions",
)
STATE_VERSION = 1


class BatchMetrics:
    """Aggregates request, step and engine measures of one batch across workers."""

    def __init__(self, max_timeline_buckets: int = DEFAULT_MAX_BUCKETS) -> None:
        self.latencies = {key: array("d") for key in LATENCY_KEYS}
        self.totals = dict.fromkeys(("requests", *TOKEN_KEYS), 0)
        self.first_arrival: float | None = None
        self.last_finish: float | None = None
        self.worker_stats: dict[str, dict] = {}
        self.worker_steps: dict[str, dict] = {}
        self.timeline = Timeline(max_timeline_buckets)

    def add_request(self, metrics: dict) -> None:
        """Count one finished request; ``metrics`` is ``RequestMetrics.as_dict()``."""
        if not isinstance(metrics, dict):
            raise TypeError(f"request metrics must be a dict, got {type(metrics).__name__}")
        for key in LATENCY_KEYS:
            value = _number(metrics, key)
            if value is not None:
                self.latencies[key].append(value)
        for key in TOKEN_KEYS:
            self.totals[key] += int(_number(metrics, key) or 0)
        self.totals["requests"] += 1
        arrival = _number(metrics, "arrival_time")
        finished = _number(metrics, "finished_time")
        if arrival is not None:
            self.first_arrival = arrival if self.first_arrival is None else min(self.first_arrival, arrival)
        if finished is not None:
            self.last_finish = finished if self.last_finish is None else max(self.last_finish, finished)

    def add_steps(self, worker_id: str, records: list[dict]) -> None:
        """Add step records from ``engine.pop_step_records()`` of one worker."""
        seen = self.worker_steps.setdefault(str(worker_id), {"steps": 0, "busy_time_s": 0.0})
        for i, record in enumerate(records):
            if not isinstance(record, dict) or "t" not in record:
                raise ValueError(f"step record {i} from worker {worker_id!r} must be a dict with a 't' key")
            self.timeline.add(record)
            seen["steps"] += 1
            seen["busy_time_s"] += float(record.get("duration_s", 0.0))

    def add_engine_stats(self, worker_id: str, stats: dict) -> None:
        """Record a worker's latest cumulative ``engine.stats()``; it replaces the previous one."""
        if not isinstance(stats, dict):
            raise TypeError(
                f"engine stats of worker {worker_id!r} must be a dict, got {type(stats).__name__}"
            )
        self.worker_stats[str(worker_id)] = dict(stats)

    def summary(self, wall_time_s: float | None = None) -> dict:
        """JSON-able measures of the batch. ``wall_time_s`` defaults to first arrival → last finish."""
        if wall_time_s is None:
            known = self.first_arrival is not None and self.last_finish is not None
            wall_time_s = max(0.0, self.last_finish - self.first_arrival) if known else 0.0
        engine = self._engine_totals()
        output_tokens = self.totals["num_output_tokens"]
        slot_steps = engine["slot_steps"]
        prefill_slots = engine["prefill_tokens"] + engine["prefill_padding_tokens"]
        return {
            "requests": self.totals["requests"],
            "wall_time_s": round(wall_time_s, 6),
            "output_tokens": output_tokens,
            "output_tokens_per_s": round(output_tokens / wall_time_s, 3) if wall_time_s > 0 else None,
            "input_tokens": self.totals["num_prompt_tokens"],
            "cached_prompt_tokens": self.totals["num_cached_tokens"],
            "slot_efficiency": slot_efficiency(engine),
            "decode_padding_pct": _pct(engine["padding_slot_steps"], slot_steps),
            "prefill_padding_pct": _pct(engine["prefill_padding_tokens"], prefill_slots),
            **{key: percentiles(self.latencies[key]) for key in LATENCY_KEYS},
            "batch_size_histogram": self._histogram(),
            "per_worker": self._per_worker(),
            "preemptions": engine["preemptions"] if self.worker_stats else self.totals["num_preemptions"],
        }

    def report(self, wall_time_s: float | None = None, bins: int = 40) -> dict:
        """Summary plus the bucketed timeline and latency histograms (ms): everything the PNG draws."""
        histograms = {}
        for key in ("ttft_s", "tpot_s"):
            values = np.frombuffer(self.latencies[key], dtype=np.float64) * 1000.0
            counts, edges = np.histogram(values, bins=bins) if len(values) else ([], [])
            histograms[key.replace("_s", "_ms")] = {
                "counts": [int(c) for c in counts],
                "edges": [float(e) for e in edges],
            }
        return {
            "summary": self.summary(wall_time_s),
            "timeline": self.timeline.points(),
            "latency_histograms": histograms,
        }

    def _engine_totals(self) -> dict:
        totals = dict.fromkeys(SUMMED_STATS, 0)
        for stats in self.worker_stats.values():
            for key in SUMMED_STATS:
                totals[key] += stats.get(key, 0) or 0
            totals["active_slot_steps"] = totals.get("active_slot_steps", 0) + _active_slot_steps(stats)
        return totals

    def _histogram(self) -> dict[str, int]:
        merged: dict[str, int] = {}
        for stats in self.worker_stats.values():
            for size, count in (stats.get("batch_size_histogram") or {}).items():
                merged[str(size)] = merged.get(str(size), 0) + int(count)
        return dict(sorted(merged.items(), key=lambda item: int(item[0])))

    def _per_worker(self) -> dict[str, dict]:
        out = {}
        for worker in sorted(set(self.worker_stats) | set(self.worker_steps)):
            stats = self.worker_stats.get(worker)
            seen = self.worker_steps.get(worker, {"steps": 0, "busy_time_s": 0.0})
            if stats is None:
                out[worker] = {"busy_time_s": round(seen["busy_time_s"], 6), "steps": seen["steps"]}
                continue
            out[worker] = {
                "busy_time_s": round(float(stats.get("busy_time_s", seen["busy_time_s"])), 6),
                "steps": int(stats.get("steps", seen["steps"])),
                "output_tokens": int(stats.get("output_tokens", 0)),
                "slot_efficiency": slot_efficiency(stats),
                "preemptions": int(stats.get("preemptions", 0)),
            }
        return out

    def to_state(self) -> dict:
        """A JSON-able snapshot a runner can store and later resume from."""
        return {
            "version": STATE_VERSION,
            "latencies": {key: list(values) for key, values in self.latencies.items()},
            "totals": dict(self.totals),
            "first_arrival": self.first_arrival,
            "last_finish": self.last_finish,
            "worker_stats": self.worker_stats,
            "worker_steps": self.worker_steps,
            "timeline": self.timeline.to_state(),
        }

    @classmethod
    def from_state(cls, state: dict) -> BatchMetrics:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"batch metrics state must be a dict with version {STATE_VERSION}, got {found!r}"
            )
        metrics = cls()
        metrics.latencies = {key: array("d", state["latencies"].get(key, [])) for key in LATENCY_KEYS}
        metrics.totals.update(state["totals"])
        metrics.first_arrival = state["first_arrival"]
        metrics.last_finish = state["last_finish"]
        metrics.worker_stats = {k: dict(v) for k, v in state["worker_stats"].items()}
        metrics.worker_steps = {k: dict(v) for k, v in state["worker_steps"].items()}
        metrics.timeline = Timeline.from_state(state["timeline"])
        return metrics


def percentiles(values: array | list[float]) -> dict:
    """p50/p95/p99 (linear interpolation, as numpy) and mean; None for each when there are no values."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "count": 0}
    p50, p95, p99 = np.percentile(data, [50, 95, 99])
    return {
        "p50": float(p50),
        "p95": float(p95),
        "p99": float(p99),
        "mean": float(data.mean()),
        "count": int(data.size),
    }


def _number(metrics: dict, key: str) -> float | None:
    value = metrics.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"request metrics field {key!r} must be a finite number, got {value!r}")
    return float(value)


def slot_efficiency(stats: dict) -> float | None:
    """Share of held slot-steps that produced a token: the simulator's useful tokens / slot-steps.

    The engine's ``useful_tokens`` also counts prefill tokens (many per slot-step), so the ratio uses
    ``active_slot_steps`` when the engine reports it, else slot-steps minus padding slot-steps."""
    return _ratio(_active_slot_steps(stats), stats.get("slot_steps") or 0)


def _active_slot_steps(stats: dict) -> float:
    active = stats.get("active_slot_steps")
    if active is None:
        return (stats.get("slot_steps") or 0) - (stats.get("padding_slot_steps") or 0)
    return active


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 6) if whole else None


def _pct(part: float, whole: float) -> float | None:
    return round(100.0 * part / whole, 4) if whole else None
