"""A tensor-parallel group is one unit (issue 46): a follower rank that dies while its group loads, or while
the group idles between batches, fails the group within seconds (rank 0 watches every follower's call), the
group is rebuilt, and the batch completes with every custom_id once. On a real local Ray: one worker of two
gloo ranks (tests/runtime/test_tensor_parallel_worker.py kills a rank mid-step). The follower is held at a
gate (tests/support/held_rank.py) before it joins its group's rendezvous, or before it loads its shard, so
the kill lands while rank 0 waits for it; the collective timeout is left at its default (300 s), so a
group that fails within the bound was not saved by it."""

from __future__ import annotations

import glob
import json
import os
import time
import urllib.request

import pytest
import ray

from bulkgen.models.registry import EVERY_MODEL
from bulkgen.runtime.pool import NAMESPACE
from bulkgen.settings import Settings, WorkerSettings
from tests.runtime.test_faults import _assert_exactly_once, _create, _rows
from tests.support.held_rank import RankGate
from tests.support.service import MODEL, Service, random_model, wait_for
from tests.support.wait import wait_until

GROUP = "bulkgen-worker-0-tp2"  # worker 0's rank 0; its follower is GROUP-rank1
FAILS_WITHIN_S = 30.0  # from the kill to rank 0's exit; the collective timeout (300 s) and the rendezvous's
# (600 s) are far beyond it


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    engine = {"max_num_seqs": 32, "max_num_batched_tokens": 512}
    service = Service(
        Settings(
            storage=str(tmp_path_factory.mktemp("tpf") / "store"),
            models={MODEL: str(random_model())},
            range_size=16,
            workers=WorkerSettings(cpu_workers=1, engine_kwargs=engine, tensor_parallel={EVERY_MODEL: 2}),
        )
    )
    yield service
    service.stop()


@pytest.fixture
def rank_gate():
    gate = RankGate(os.environ["BULKGEN_TEST_GATE"])
    yield gate
    gate.open()


def _rank0_pid(service) -> int | None:
    url = f"{service.base_url}/dashboard/workers"
    workers = json.loads(urllib.request.urlopen(url, timeout=30).read())["data"]
    ranks = next(w for w in workers if w["index"] == 0)["ranks"]
    return ranks[0]["pid"] if ranks else None


def _dead(actor) -> bool:
    try:
        ray.get(actor.poll.remote("", 0.0), timeout=5)
        return False
    except ray.exceptions.RayActorError:
        return True
    except ray.exceptions.GetTimeoutError:
        return False


def _kill_follower(rank_gate=None) -> tuple[object, float]:
    """Kill the group's follower actor (opening the gate first, so its replacement is not held too);
    rank 0's handle and how long rank 0 outlived the kill."""
    rank0, follower = ray.get_actor(GROUP, NAMESPACE), ray.get_actor(f"{GROUP}-rank1", NAMESPACE)
    pid = ray.get(rank0.info.remote(), timeout=30)["pid"]
    if rank_gate is not None:
        rank_gate.open()
    killed = time.monotonic()
    ray.kill(follower)
    wait_until(lambda: _dead(rank0), FAILS_WITHIN_S, "rank 0 to fail its group after the follower's kill")
    took = time.monotonic() - killed
    print(f"follower killed: rank 0 gone after {took:.2f} s")
    return pid, took


def _says_why(pid: int) -> str:
    """What rank 0 (process `pid`) wrote before it exited: its Ray worker log."""
    session = ray._private.worker._global_node.get_session_dir_path()
    text = ""
    for path in glob.glob(f"{session}/logs/worker-*-{pid}.err") + glob.glob(
        f"{session}/logs/worker-*-{pid}.out"
    ):
        with open(path, errors="replace") as f:
            text += f.read()
    return text


@pytest.mark.parametrize("at", ["join", "load"])
def test_a_follower_killed_while_its_group_loads_fails_the_group_within_seconds(
    service, tmp_path, rank_gate, at
):
    """Killed before it joins the rendezvous (rank 0 waits in the process group's start: 600 s before the
    fix) or before it loads its shard (rank 0's load failed with RankLost, and the batch was failed as a
    model that cannot load): rank 0 exits within seconds naming the rank, a new group is placed, and the
    batch completes, every line once."""
    client = service.client()
    rank_gate.close(at)
    if _rank0_pid(service) is not None:  # a group left loaded by the previous case: fail it, unheld
        _kill_follower()
    rows = _rows(f"{at}-", 40, 8)
    batch = _create(client, tmp_path / "tp.jsonl", rows)
    rank_gate.wait_held(timeout=300)
    time.sleep(1.0)  # rank 0 is waiting for it now: in the rendezvous, or in its first collective
    pid, took = _kill_follower(rank_gate)
    assert took < FAILS_WITHIN_S
    why = _says_why(pid)
    assert "tensor-parallel rank 1" in why and GROUP in why, why[-2000:]
    batch = wait_for(client, batch.id, lambda b: b.status in {"completed", "failed"}, timeout=400)
    assert batch.status == "completed" and batch.request_counts.failed == 0, batch
    _assert_exactly_once(client, batch, rows)
    assert wait_until(lambda: _rank0_pid(service), 120, "the new group's ranks") != pid


def test_a_follower_killed_while_its_group_idles_fails_the_group_and_the_next_batch_runs(service, tmp_path):
    """No step runs, so no collective would notice the dead follower: the watch does, and the group is
    rebuilt before the next batch needs it (before the fix rank 0 lived on with a dead peer)."""
    client = service.client()
    first = _rows("warm-", 16, 4)
    batch = wait_for(
        client, _create(client, tmp_path / "a.jsonl", first).id, lambda b: b.status == "completed", 300
    )
    pid, took = _kill_follower()
    assert took < FAILS_WITHIN_S
    rows = _rows("idle-", 40, 8)
    batch = _create(client, tmp_path / "b.jsonl", rows)
    batch = wait_for(client, batch.id, lambda b: b.status in {"completed", "failed"}, timeout=400)
    assert batch.status == "completed" and batch.request_counts.failed == 0
    _assert_exactly_once(client, batch, rows)
    assert _rank0_pid(service) != pid


def test_a_follower_killed_while_its_group_steps_fails_the_group_within_seconds(service, tmp_path):
    """Killed while rank 0 steps a batch (no gate: every step's collectives run): the group fails within
    seconds, not after the collective timeout, and the batch completes with every custom_id once."""
    client = service.client()
    rows = _rows("step-", 160, 24)
    batch = _create(client, tmp_path / "s.jsonl", rows)
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 16, timeout=300)
    pid, took = _kill_follower()
    assert took < FAILS_WITHIN_S
    batch = wait_for(client, batch.id, lambda b: b.status in {"completed", "failed"}, timeout=400)
    assert batch.status == "completed" and batch.request_counts.failed == 0
    _assert_exactly_once(client, batch, rows)
    assert wait_until(lambda: _rank0_pid(service), 120, "the new group's ranks") != pid
