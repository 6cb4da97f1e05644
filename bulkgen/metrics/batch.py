"""Metrics of one real batch: throughput, slot efficiency, padding waste and latency percentiles.

Fed with the batch's own finished requests (``RequestMetrics.as_dict()``) and its own share of each
engine step (workers split every step record by batch), so a batch that shares workers with others
counts only its work. ``summary()`` is what the batch object, ``bulkgen status --metrics`` and the
stored report show. Memory and the persisted state stay bounded whatever the batch size: latencies go
into log-bucketed sketches (1% relative error on any percentile), step records into per-worker sums and
a bucketed timeline. ``to_state()``/``from_state()`` let a resumed runner report the whole batch.
"""

from __future__ import annotations

import math

import numpy as np

from bulkgen.engine.sketch import LogHistogram
from bulkgen.metrics.health import OutputHealth
from bulkgen.metrics.timeline import DEFAULT_MAX_BUCKETS, Timeline

LATENCY_KEYS = ("ttft_s", "tpot_s", "queue_wait_s")
TOKEN_KEYS = ("num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "num_preemptions")
STEP_SUMS = (
    "steps",
    "busy_time_s",
    "slot_steps",
    "active_slot_steps",
    "prefill_tokens",
    "decode_tokens",
    "padding_slot_steps",
)
SPAN = ("first_step_start", "last_step_end")
ADAPTER_KEYS = ("requests", "input_tokens", "output_tokens")
STATE_VERSION = 2


class BatchMetrics:
    """Aggregates request and step measures of one batch across workers."""

    def __init__(self, max_timeline_buckets: int = DEFAULT_MAX_BUCKETS) -> None:
        self.latencies = {key: LogHistogram() for key in LATENCY_KEYS}
        self.totals = dict.fromkeys(("requests", *TOKEN_KEYS), 0)
        self.first_arrival: float | None = None
        self.last_finish: float | None = None
        self.prefill_padding_tokens = 0
        self.workers: dict[str, dict] = {}
        self.batch_sizes: dict[str, int] = {}
        self.adapters: dict[
            str, dict[str, int]
        ] = {}  # per LoRA adapter its lines named (bounded: served ones)
        self.timeline = Timeline(max_timeline_buckets)
        self.health = OutputHealth()  # what the answers are (bulkgen.batch.health classifies them)

    def add_request(self, metrics: dict) -> None:
        """Count one finished request; ``metrics`` is ``RequestMetrics.as_dict()``."""
        if not isinstance(metrics, dict):
            raise TypeError(f"request metrics must be a dict, got {type(metrics).__name__}")
        for key in LATENCY_KEYS:
            value = _number(metrics, key)
            if value is not None:
                self.latencies[key].add(value)
        for key in TOKEN_KEYS:
            self.totals[key] += int(_number(metrics, key) or 0)
        self.totals["requests"] += 1
        if isinstance(metrics.get("lora"), str):
            counts = self.adapters.setdefault(metrics["lora"], dict.fromkeys(ADAPTER_KEYS, 0))
            counts["requests"] += 1
            counts["input_tokens"] += int(_number(metrics, "num_prompt_tokens") or 0)
            counts["output_tokens"] += int(_number(metrics, "num_output_tokens") or 0)
        arrival = _number(metrics, "arrival_time")
        finished = _number(metrics, "finished_time")
        if arrival is not None:
            self.first_arrival = arrival if self.first_arrival is None else min(self.first_arrival, arrival)
        if finished is not None:
            self.last_finish = finished if self.last_finish is None else max(self.last_finish, finished)

    def add_steps(self, worker_id: str, records: list[dict]) -> None:
        """Add this batch's step records from one worker (``engine.pop_step_records()`` shape:
        t, duration_s, num_seqs = slots it held, active_seqs, prefill/decode tokens, padding_slots;
        ``batch_size``, when given, is the whole step's size for the histogram)."""
        sums = self.workers.setdefault(str(worker_id), {**dict.fromkeys(STEP_SUMS, 0), **dict.fromkeys(SPAN)})
        for i, record in enumerate(records):
            if not isinstance(record, dict) or "t" not in record:
                raise ValueError(f"step record {i} from worker {worker_id!r} must be a dict with a 't' key")
            self.timeline.add(record)
            start = float(record["t"]) - float(record.get("duration_s", 0.0))
            first, last = sums["first_step_start"], sums["last_step_end"]
            sums["first_step_start"] = start if first is None else min(first, start)
            sums["last_step_end"] = float(record["t"]) if last is None else max(last, float(record["t"]))
            held = int(record.get("num_seqs", 0))
            sums["steps"] += 1
            sums["busy_time_s"] += float(record.get("duration_s", 0.0))
            sums["slot_steps"] += held
            sums["active_slot_steps"] += int(record.get("active_seqs", held))
            sums["prefill_tokens"] += int(record.get("prefill_tokens", 0))
            sums["decode_tokens"] += int(record.get("decode_tokens", 0))
            sums["padding_slot_steps"] += int(record.get("padding_slots", 0))
            size = str(record.get("batch_size", held))
            self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1

    def add_prefill_padding(self, tokens: int) -> None:
        """Prompt tokens a static policy padded (the engine counts them per run, not per step)."""
        self.prefill_padding_tokens += int(tokens)

    def summary(self, wall_time_s: float | None = None) -> dict:
        """JSON-able measures of the batch. ``wall_time_s`` defaults to first arrival → last finish."""
        if wall_time_s is None:
            known = self.first_arrival is not None and self.last_finish is not None
            wall_time_s = max(0.0, self.last_finish - self.first_arrival) if known else 0.0
        engine = {key: sum(w[key] for w in self.workers.values()) for key in STEP_SUMS}
        output_tokens = self.totals["num_output_tokens"]
        prefill_slots = engine["prefill_tokens"] + self.prefill_padding_tokens
        return {
            "requests": self.totals["requests"],
            "wall_time_s": round(wall_time_s, 6),
            "output_tokens": output_tokens,
            "output_tokens_per_s": round(output_tokens / wall_time_s, 3) if wall_time_s > 0 else None,
            "input_tokens": self.totals["num_prompt_tokens"],
            # an embeddings batch's throughput (it outputs no tokens)
            "input_tokens_per_s": round(self.totals["num_prompt_tokens"] / wall_time_s, 3)
            if wall_time_s > 0
            else None,
            "cached_prompt_tokens": self.totals["num_cached_tokens"],
            "slot_efficiency": slot_efficiency(engine),
            "decode_padding_pct": _pct(engine["padding_slot_steps"], engine["slot_steps"]),
            "prefill_padding_pct": _pct(self.prefill_padding_tokens, prefill_slots),
            **{key: _percentiles(self.latencies[key]) for key in LATENCY_KEYS},
            "batch_size_histogram": dict(sorted(self.batch_sizes.items(), key=lambda item: int(item[0]))),
            "per_worker": self._per_worker(),
            "preemptions": self.totals["num_preemptions"],
            # the requests and tokens of each LoRA adapter (the rest ran on the base model)
            "adapters": {name: dict(counts) for name, counts in sorted(self.adapters.items())},
            "output_health": self.health.summary(),
        }

    def report(self, wall_time_s: float | None = None, bins: int = 40) -> dict:
        """Summary plus the bucketed timeline and latency histograms (ms): everything the PNG draws."""
        histograms = {}
        for key in ("ttft_s", "tpot_s"):
            counts, edges = self.latencies[key].histogram(bins)
            histograms[key.replace("_s", "_ms")] = {"counts": counts, "edges": [e * 1000.0 for e in edges]}
        return {
            "summary": self.summary(wall_time_s),
            "timeline": self.timeline.points(),
            "latency_histograms": histograms,
        }

    def _per_worker(self) -> dict[str, dict]:
        """busy: the worker's time on this batch's steps; idle: the rest of the span in which it served
        the batch (no step at all, or steps of other batches sharing the worker)."""

        def span(sums: dict) -> float:
            first, last = sums.get("first_step_start"), sums.get("last_step_end")
            return (last - first) if first is not None and last is not None else 0.0

        return {
            worker: {
                "busy_time_s": round(sums["busy_time_s"], 6),
                "idle_time_s": round(max(0.0, span(sums) - sums["busy_time_s"]), 6),
                "steps": sums["steps"],
                "slot_efficiency": slot_efficiency(sums),
            }
            for worker, sums in sorted(self.workers.items())
        }

    def to_state(self) -> dict:
        """A JSON-able snapshot of bounded size that a runner can store and later resume from."""
        return {
            "version": STATE_VERSION,
            "latencies": {key: sketch.to_state() for key, sketch in self.latencies.items()},
            "totals": dict(self.totals),
            "first_arrival": self.first_arrival,
            "last_finish": self.last_finish,
            "prefill_padding_tokens": self.prefill_padding_tokens,
            "workers": self.workers,
            "batch_sizes": self.batch_sizes,
            "adapters": self.adapters,
            "timeline": self.timeline.to_state(),
            "health": self.health.to_state(),
        }

    @classmethod
    def from_state(cls, state: dict) -> BatchMetrics:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            found = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"batch metrics state must be a dict with version {STATE_VERSION}, got {found!r}"
            )
        metrics = cls()
        metrics.latencies = {key: LogHistogram.from_state(state["latencies"][key]) for key in LATENCY_KEYS}
        metrics.totals.update(state["totals"])
        metrics.first_arrival = state["first_arrival"]
        metrics.last_finish = state["last_finish"]
        metrics.prefill_padding_tokens = int(state["prefill_padding_tokens"])
        metrics.workers = {k: dict(v) for k, v in state["workers"].items()}
        metrics.batch_sizes = {k: int(v) for k, v in state["batch_sizes"].items()}
        metrics.adapters = {k: dict(v) for k, v in state.get("adapters", {}).items()}  # none before adapters
        metrics.timeline = Timeline.from_state(state["timeline"])
        metrics.health = OutputHealth.from_state(state.get("health"))  # none in a state stored before it
        return metrics


def percentiles(values) -> dict:
    """Exact p50/p95/p99 (linear interpolation, as numpy) and mean of a list: for benches and tests."""
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


def _percentiles(sketch: LogHistogram) -> dict:
    if not sketch.count:
        return {"p50": None, "p95": None, "p99": None, "mean": None, "count": 0}
    return {
        "p50": sketch.quantile(0.5),
        "p95": sketch.quantile(0.95),
        "p99": sketch.quantile(0.99),
        "mean": sketch.total / sketch.count,
        "count": sketch.count,
    }


def _number(metrics: dict, key: str) -> float | None:
    value = metrics.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"request metrics field {key!r} must be a finite number, got {value!r}")
    return float(value)


def slot_efficiency(stats: dict) -> float | None:
    """Share of held slot-steps that produced a token (from engine counters: ``Engine.stats()``)."""
    active = stats.get("active_slot_steps")
    if active is None:
        active = (stats.get("slot_steps") or 0) - (stats.get("padding_slot_steps") or 0)
    return _ratio(active, stats.get("slot_steps") or 0)


def _ratio(part: float, whole: float) -> float | None:
    return round(part / whole, 6) if whole else None


def _pct(part: float, whole: float) -> float | None:
    return round(100.0 * part / whole, 4) if whole else None
