"""Keep Python's full garbage collections off the engine's steps.

A worker process holds one loaded engine for hours: the model's modules, the tokenizer, the processor and
the cache's bookkeeping are hundreds of thousands of container objects that live as long as the engine.
CPython's oldest-generation collection walks every one of them each time it runs, and it runs while the
engine thread is inside a step: on the host-overhead bench's 1,536-request run one such collection took
288 ms, stalling a decode step that otherwise takes about 2 ms of host time (`bench/bench_host.py
--gc`). Moving everything alive once the engine is loaded into CPython's permanent generation
(`gc.freeze`) takes it out of every later collection; vLLM's engine core does the same after start-up.

Frozen objects are never collected as cycles, so the heap is thawed before an engine is dropped (a
model switch), letting the old engine's cycles be collected, and frozen again once the next is loaded.
"""

from __future__ import annotations

import gc


def freeze_loaded() -> None:
    """After an engine is loaded: collect what loading left behind, then freeze all that is still alive."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Before an engine is dropped: make its objects collectable again (the next freeze_loaded collects)."""
    gc.unfreeze()
