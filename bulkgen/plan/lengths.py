"""How many tokens a batch will really generate: the length model behind `expected_output_tokens`.

Models stop before max_tokens most of the time, so max_tokens alone overstates a batch's time (often by
2x or more), and the overstatement sits in the tail: a request allowed 128 tokens that stops after 30
decides how many steps the batch takes. So the model is a cap, not a share: a request is expected to
generate min(max_tokens, cap) tokens. The cap comes, in order of preference, from
  1. earlier batches of the same model on this service: for each of the last RECENT_BATCHES completed
     ones, the cap that explains its usage.output_tokens given its max_tokens (a histogram recorded when
     it was validated); their median;
  2. otherwise no cap: max_tokens itself, an upper bound, and said so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bulkgen.batch.records import BatchRepo
from bulkgen.batch.schema import BatchStatus

RECENT_BATCHES = 100
MAX_OUTPUT_KEY = "max_output_tokens"  # record.internal[...]: set when a batch is validated
HISTOGRAM_KEY = "max_tokens_histogram"  # [[max_tokens, sequences], ...], at most HISTOGRAM_BINS rows
HISTOGRAM_BINS = 64


@dataclass(frozen=True)
class LengthModel:
    cap: float  # expected output tokens = min(max_tokens, cap); inf: max_tokens itself
    source: str  # what the cap comes from, in words

    def expected(self, max_tokens: np.ndarray) -> np.ndarray:
        """Per-sequence expected output tokens; at least one for a sequence that generates at all."""
        if math.isinf(self.cap):
            return max_tokens.astype(np.int64)
        capped = np.maximum(1, np.rint(np.minimum(max_tokens, self.cap)))
        return np.where(max_tokens > 0, capped, 0).astype(np.int64)


UPPER_BOUND = LengthModel(
    math.inf, "max_tokens (an upper bound: no earlier batch of this model measured here)"
)


def histogram(max_tokens: np.ndarray) -> list[list[int]]:
    """max_tokens as [[value, count], ...]; beyond HISTOGRAM_BINS distinct values, rounded to 2^(k/8)."""
    values, counts = np.unique(max_tokens[max_tokens > 0], return_counts=True)
    if len(values) > HISTOGRAM_BINS:
        rounded = np.rint(2 ** (np.rint(np.log2(max_tokens[max_tokens > 0]) * 8) / 8))
        values, counts = np.unique(rounded, return_counts=True)
    return [[int(v), int(c)] for v, c in zip(values, counts, strict=True)]


def cap_for(hist: list[list[int]], generated: int) -> float:
    """The cap c with sum(count × min(value, c)) = generated (inf if the batch ran every request to its end)."""
    values = np.array([v for v, _ in hist], float)
    counts = np.array([c for _, c in hist], float)
    if not len(values) or generated >= (values * counts).sum():
        return math.inf
    low, high = 0.0, float(values.max())
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if (np.minimum(values, mid) * counts).sum() < generated else (low, mid)
    return high


def from_history(batches: BatchRepo, model: str) -> LengthModel:
    """The median cap of this model's recent completed batches, or the max_tokens upper bound."""
    caps = []
    records, _ = batches.list(None, RECENT_BATCHES)
    for record in records:
        hist = record.internal.get(HISTOGRAM_KEY)
        if record.model == model and record.status == BatchStatus.COMPLETED and hist:
            caps.append(cap_for(hist, record.usage["output_tokens"]))
    if not caps:
        return UPPER_BOUND
    cap = float(np.median(caps))
    told = "none reached" if math.isinf(cap) else f"{cap:.1f} tokens"
    return LengthModel(cap, f"earlier batches of {model} here ({len(caps)}; median length cap {told})")
