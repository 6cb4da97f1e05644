"""Conditional writes: the batch-record guarantee that two writers never silently overwrite each other."""

from __future__ import annotations

import json
import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from bulkgen.store import PreconditionFailed, Store, open_store


def test_if_none_match_creates_once(store):
    version = store.write_bytes("batches/b1.json", b"first", if_none_match=True)
    with pytest.raises(PreconditionFailed, match="batches/b1.json"):
        store.write_bytes("batches/b1.json", b"second", if_none_match=True)
    assert store.read_versioned("batches/b1.json") == (b"first", version)


def test_if_match_needs_the_current_version(store):
    old = store.write_bytes("rec", b"v1")
    new = store.write_bytes("rec", b"v2", if_match=old)
    with pytest.raises(PreconditionFailed, match="rec"):
        store.write_bytes("rec", b"v3", if_match=old)
    assert store.read_versioned("rec") == (b"v2", new)
    with pytest.raises(PreconditionFailed, match="missing"):
        store.write_bytes("missing", b"x", if_match=new)
    assert not store.exists("missing")


def _race(store: Store, key: str, version: str, writer: int, barrier) -> bool:
    barrier.wait()
    try:
        store.write_bytes(key, f"writer {writer}".encode(), if_match=version)
    except PreconditionFailed:
        return False
    return True


@pytest.mark.parametrize("round_", range(3))
def test_racing_writers_exactly_one_wins_threads(store, round_):
    version = store.write_bytes("race", b"start")
    writers = 4
    barrier = threading.Barrier(writers)
    with ThreadPoolExecutor(writers) as pool:
        wins = list(pool.map(lambda i: _race(store, "race", version, i, barrier), range(writers)))
    assert sum(wins) == 1
    assert store.read_bytes("race") == f"writer {wins.index(True)}".encode()


def _clean_processes():
    """Children forked from a single-threaded fork server that has imported the store already: as
    safe as spawning, without paying the imports per child."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["bulkgen.store"])
    return ctx


def _process_race(spec: dict, version: str, writer: int, barrier, results) -> None:
    try:
        results.put((writer, _race(open_store(**spec), "race", version, writer, barrier)))
    except BaseException as exc:  # the parent shows it instead of waiting for a result that never comes
        results.put((writer, f"{type(exc).__name__}: {exc}"))
        raise


def test_racing_writers_exactly_one_wins_processes(store):
    """Separate processes, as Ray workers are (the local backend relies on an fcntl lock for this).
    Not forked from here: a fork of this threaded process (moto's server, boto3's pools) can inherit a
    lock another thread held, and the child hangs."""
    ctx = _clean_processes()
    writers = 4
    for _ in range(3):
        version = store.write_bytes("race", b"start")
        barrier, results = ctx.Barrier(writers), ctx.Queue()
        procs = [
            ctx.Process(target=_process_race, args=(store.open_args(), version, i, barrier, results))
            for i in range(writers)
        ]
        for proc in procs:
            proc.start()
        outcome = dict(results.get(timeout=120) for _ in procs)
        assert all(isinstance(won, bool) for won in outcome.values()), outcome
        for proc in procs:
            proc.join(timeout=30)
            assert proc.exitcode == 0
        winners = [writer for writer, won in outcome.items() if won]
        assert len(winners) == 1
        assert store.read_bytes("race") == f"writer {winners[0]}".encode()


def _increment(store: Store, times: int) -> int:
    """Read-modify-write with retry on a lost condition, as the batch records do; returns lost races."""
    lost = 0
    for _ in range(times):
        while True:
            data, version = store.read_versioned("counter")
            try:
                store.write_bytes("counter", json.dumps(json.loads(data) + 1).encode(), if_match=version)
                break
            except PreconditionFailed:
                lost += 1
    return lost


def _increment_in_process(spec: dict, times: int) -> None:
    _increment(open_store(**spec), times)


def test_no_lost_updates_across_processes(tmp_path):
    store = open_store(str(tmp_path), fsync=False)
    store.write_bytes("counter", b"0")
    ctx = _clean_processes()
    procs = [ctx.Process(target=_increment_in_process, args=(store.open_args(), 40)) for _ in range(3)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    assert json.loads(store.read_bytes("counter")) == 120


def test_no_lost_updates_across_threads(store):
    store.write_bytes("counter", b"0")
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: _increment(store, 15), range(3)))
    assert json.loads(store.read_bytes("counter")) == 45
