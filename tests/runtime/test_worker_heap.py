"""The worker freezes the heap once a model is loaded and thaws it before dropping an engine (engine/heap.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from bulkgen.engine import heap
from bulkgen.engine.config import EngineConfig
from bulkgen.runtime.worker import EngineWorker
from tests.support.service import MODEL, random_model


@pytest.fixture
def thawed():
    """The test process's heap as it was: frozen objects would never be collected as cycles afterwards."""
    heap.thaw()
    yield
    heap.thaw()
    gc.collect()


def _tracked(obj) -> bool:
    """Whether a collection would walk `obj`: frozen objects are in no generation."""
    return any(o is obj for o in gc.get_objects())


def test_a_loaded_engine_is_out_of_every_collection_and_a_dropped_one_is_collected(thawed):
    worker = EngineWorker(0, EngineConfig(max_num_seqs=4))
    worker.load(MODEL, str(random_model()))
    first = worker.engine
    assert gc.get_freeze_count() > 0
    assert not _tracked(first) and not _tracked(first.scheduler)
    # a reference cycle through the engine, as a forward hook closing over its own module makes one
    first.model.cycle = {"model": first.model}
    gone = weakref.ref(first.model)
    del first
    worker.load("another-name", str(random_model()))  # a model switch: a new engine replaces the first
    assert gone() is None, "the dropped engine's model stayed frozen: its cycles can never be collected"
    assert not _tracked(worker.engine)
    assert worker.info()["model"] == "another-name"
