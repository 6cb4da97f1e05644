"""`bulkgen run --tensor-parallel 2` whose follower is killed while its group loads (issue 46: 0 of 120 lines
in 553 s): the run's driver preloads the model, the follower is held at the gate before its shard's load
(tests/support/held_rank.py) and killed there; rank 0 fails its group within seconds, the group is
rebuilt, and the run writes every line once. In this process, on the suite's real local Ray."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import ray
from click.testing import CliRunner
from ray.util.placement_group import get_placement_group, remove_placement_group

from bulkgen.cli import cli
from bulkgen.runtime.pool import NAMESPACE
from tests.runtime.test_faults import _rows
from tests.support.held_rank import RankGate
from tests.support.service import MODEL, random_model, write_jsonl
from tests.support.wait import wait_until

GROUP = "bulkgen-worker-0-tp2"


@pytest.fixture
def group_removed():
    """`bulkgen run` leaves its workers to the Ray it ran on (a service may share them), and in this process
    that is the suite's Ray: its group is removed after the test, and its names freed, or the next pool of
    that name would join it, or fail to name its own follower."""
    yield
    names = [GROUP, f"{GROUP}-rank1"]
    for name in names:
        try:
            ray.kill(ray.get_actor(name, NAMESPACE))
        except ValueError:  # none
            pass
    try:
        remove_placement_group(get_placement_group(GROUP))
    except ValueError:
        pass
    wait_until(lambda: not any(_named(name) for name in names), 60, "the run's group to be gone")


def _named(name: str) -> bool:
    try:
        ray.get_actor(name, NAMESPACE)
        return True
    except ValueError:
        return False


def _kill_held_follower(gate: RankGate, took: list[float]) -> None:
    """Once the follower holds at the gate: open it (its replacement loads unheld), kill it, and time how
    long rank 0 outlives it."""
    gate.wait_held(timeout=300)
    time.sleep(1.0)  # rank 0 waits for it in its first collective now
    rank0, follower = ray.get_actor(GROUP, NAMESPACE), ray.get_actor(f"{GROUP}-rank1", NAMESPACE)
    gate.open()
    killed = time.monotonic()
    ray.kill(follower)
    while time.monotonic() - killed < 60:
        try:
            ray.get(rank0.poll.remote("", 0.0), timeout=5)
        except ray.exceptions.RayActorError:
            took.append(time.monotonic() - killed)
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.05)


@pytest.mark.ray  # `bulkgen run`: a local Ray, its worker and follower ranks
def test_run_with_a_follower_killed_while_its_group_loads_writes_every_line_once(tmp_path, group_removed):
    gate = RankGate(os.environ["BULKGEN_TEST_GATE"])
    gate.close("load")
    rows = _rows("run-", 120, 8)
    took: list[float] = []
    killer = threading.Thread(target=_kill_held_follower, args=(gate, took), daemon=True)
    killer.start()
    try:
        result = CliRunner().invoke(
            cli,
            [
                "run",
                str(write_jsonl(tmp_path / "in.jsonl", rows)),
                "--output",
                str(tmp_path / "out.jsonl"),
                "--storage",
                str(tmp_path / "store"),
                "--model",
                f"{MODEL}={random_model()}",
                "--tensor-parallel",
                "2",
                "--cpu-workers",
                "1",
            ],
        )
    finally:
        gate.open()
    killer.join(60)
    print(f"bulkgen run: rank 0 gone {took} s after its follower's kill")
    assert took and took[0] < 30.0
    assert result.exit_code == 0, result.output
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in out] == [r["custom_id"] for r in rows]  # each once, in order
