"""How much slower steps run inside the service than in `bulkgen profile`: the runtime factor.

The profile times the engine alone. Inside a running service its steps share the cores with the worker's
other threads, the driver and Ray; on a 2-core machine that made them 1.2-1.6x slower. Every finished
batch reports its own engine time (`metrics.per_worker[*].busy_time_s`, `steps`) and its tokens, so the
factor is measured, not guessed: each recent completed batch of the model gives

    (what the profile says steps like its would cost, its measured busy time)

(its steps, prefill tokens = input - cached, one sequence-slot per output token, decode context about
output × (prompt + output / 2) per request); over the last RECENT_BATCHES a line is fitted through these
points (`Runtime`). Without such a batch the factor is 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bulkgen.batch.records import BatchRepo
from bulkgen.batch.schema import BatchStatus
from bulkgen.plan.lengths import RECENT_BATCHES
from bulkgen.plan.profile import Profile

MIN_BUSY_S = 5.0  # shorter batches measure the noise of their start more than the steps: not used
LIMITS = (0.5, 4.0)  # a factor outside these says the profile is for other hardware: clipped, not trusted


@dataclass(frozen=True)
class Runtime:
    """Seconds inside the service = overhead_s + factor × seconds the profile predicts."""

    factor: float = 1.0
    overhead_s: float = 0.0
    source: str = "none (no earlier batch of this model here kept an engine busy 5 s or more)"

    def seconds(self, engine_seconds: float) -> float:
        return self.overhead_s + self.factor * engine_seconds


def runtime_factor(batches: BatchRepo, model: str, profile: Profile) -> Runtime:
    """Fitted on the recent completed batches: a line through (predicted, measured) busy time once two
    batches of different size exist (a short batch pays the start of its run: the driver validating,
    indexing and publishing beside its first steps), else the ratio of one."""
    points = []
    records, _ = batches.list(None, RECENT_BATCHES)
    for record in records:
        metrics = record.metrics or {}
        done = record.status == BatchStatus.COMPLETED and metrics.get("per_worker")
        if record.model != model or not done:
            continue
        predicted = _predicted_busy(metrics, profile)
        busy = sum(w["busy_time_s"] for w in metrics["per_worker"].values())
        if predicted > 0 and busy >= MIN_BUSY_S:
            points.append((predicted, busy))
    if not points:
        return Runtime()
    x, y = np.array(points).T
    overhead, factor = 0.0, float(np.median(y / x))
    if len(points) >= 2 and x.max() > 2 * x.min():
        factor, overhead = np.polyfit(x, y, 1)
        if overhead < 0 or factor <= 0:
            overhead, factor = 0.0, float(np.median(y / x))
    factor = float(np.clip(factor, *LIMITS))
    return Runtime(
        factor,
        round(float(overhead), 3),
        f"x{factor:.2f} + {overhead:.2f} s, measured on {len(points)} earlier batch(es) here",
    )


def _predicted_busy(metrics: dict, profile: Profile) -> float:
    steps = sum(w["steps"] for w in metrics["per_worker"].values())
    requests = max(1, metrics.get("requests") or 1)
    inputs, outputs = metrics.get("input_tokens") or 0, metrics.get("output_tokens") or 0
    prefill = inputs - (metrics.get("cached_prompt_tokens") or 0)
    context = outputs * (inputs / requests + outputs / requests / 2)
    return (
        steps * profile.base_s
        + profile.per_seq_s * (outputs + requests)
        + profile.per_prefill_token_s * prefill
        + profile.per_context_token_s * context
        + profile.per_new_seq_s * requests
    )
