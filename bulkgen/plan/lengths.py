"""How many tokens a batch will really generate: the length model behind `expected_output_tokens`.

Models stop before max_tokens most of the time, so max_tokens alone overstates a batch's time (often by
2x or more). The model, in order of preference:
  1. earlier batches of the same model on this service: the share of their max_tokens they actually
     generated (usage.output_tokens / the max_output_tokens recorded when each was validated), over the
     last RECENT_BATCHES completed ones;
  2. otherwise max_tokens itself: an upper bound, and said so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bulkgen.batch.records import BatchRepo
from bulkgen.batch.schema import INTERNAL

RECENT_BATCHES = 100
MAX_OUTPUT_KEY = "max_output_tokens"  # record[INTERNAL][...]: set when a batch is validated


@dataclass(frozen=True)
class LengthModel:
    share: float    # expected output tokens / max_tokens
    source: str     # what the share comes from, in words

    def expected(self, max_tokens: np.ndarray) -> np.ndarray:
        """Per-sequence expected output tokens; at least one for a sequence that generates at all."""
        return np.where(max_tokens > 0, np.maximum(1, np.rint(max_tokens * self.share)), 0).astype(np.int64)


UPPER_BOUND = LengthModel(1.0, "max_tokens (upper bound: no earlier batch of this model measured here)")


def from_history(batches: BatchRepo, model: str) -> LengthModel:
    """The share measured on this model's recent completed batches, or the max_tokens upper bound."""
    generated = budget = found = 0
    records, _ = batches.list(None, RECENT_BATCHES)
    for record in records:
        planned = (record.get(INTERNAL) or {}).get(MAX_OUTPUT_KEY)
        if record.get("model") != model or record.get("status") != "completed" or not planned:
            continue
        generated += record["usage"]["output_tokens"]
        budget += planned
        found += 1
    if not found:
        return UPPER_BOUND
    share = min(1.0, generated / budget)
    return LengthModel(share, f"earlier batches of {model} here ({found}, {generated} of {budget} max_tokens "
                              f"generated: {share:.0%})")
