"""The plan's simulator holds a file's requests in arrays, not objects (issue 49: `bulkgen plan` of 10M lines):
its peak above its inputs, measured with tracemalloc in a fresh interpreter (tracemalloc counts every thread's
allocations, and a test process may have other tests' threads allocating beside it), stays at a few machine
words a request. Lists of (prompt, output, encoder seconds) tuples, dealt into per-worker lists and sorted
copies, took ~100 bytes a request."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from bulkgen.plan.timed import EngineLimits, batch_seconds
from tests.support.fresh import measure_fresh

REQUESTS = 100_000


def measure(requests: int = REQUESTS) -> dict:
    """batch_seconds over `requests` short requests for two workers: its peak bytes a request above the
    inputs, and its answer."""
    rng = np.random.default_rng(0)
    prompts, outputs = rng.integers(5, 60, requests), rng.integers(1, 4, requests)
    limits = EngineLimits(max_num_seqs=64, max_num_batched_tokens=2048, block_size=16, decode_padded=True)

    def cost(seqs, prefill, context, new):
        return 1e-3 + 1e-5 * seqs + 1e-6 * prefill + 1e-8 * context

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        seconds = batch_seconds(prompts, outputs, cost, limits, workers=2)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return {"peak": peak / requests, "seconds": seconds}


@pytest.mark.subprocess  # a fresh interpreter (tests/support/fresh.py)
def test_the_simulator_holds_a_few_words_a_request():
    result = measure_fresh("tests.plan.test_timed_memory", "measure")
    print(f"the simulator over {REQUESTS:,} requests: peak {result['peak']:.0f} B a request")
    assert result["seconds"] > 0
    assert result["peak"] < 48, result  # 28 in arrays; ~100 as lists of tuples
