"""A tensor-parallel group's GPU placement without GPUs: a private local Ray that declares two GPUs (Ray
hands them out by id and sets each actor's CUDA_VISIBLE_DEVICES; the ranks compute on the CPU, as no
CUDA is here) runs the real pool with --tensor-parallel 2. It places one group: two bundles of one GPU
each, STRICT_PACK, rank 0 the worker and rank 1 a follower actor, each with a GPU of its own on one
node; the group loads a model on both ranks and generates; shutdown removes its placement group and
ends its follower. It runs in a child process, since this process's Ray (shared by the suite) has no
GPUs and one process holds one Ray."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bulkgen.runtime.groups import FollowerLauncher
from tests.support.service import MODEL, random_model

SCRIPT = """
import json, sys, ray
from ray.util.placement_group import placement_group_table
from bulkgen.runtime.pool import WorkerPool
from bulkgen.settings import WorkerSettings

ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
         configure_logging=False, object_store_memory=80 * 1024 * 1024, _node_ip_address="127.0.0.1")
pool = WorkerPool(WorkerSettings(cpu_threads=1), rank_counts=[2])
(worker,) = pool.start()
ray.get(worker.load.remote(sys.argv[1], sys.argv[2]), timeout=240)
poll = ray.get(worker.poll.remote("", 0.0), timeout=60)
(group,) = pool.groups.values()
table = placement_group_table(group.placement)
pool.shutdown()
try:
    ray.get(group.followers[0].where.remote(), timeout=60)
    follower = "alive"
except ray.exceptions.RayActorError:
    follower = "dead"
state = placement_group_table(group.placement)["state"]
print("RESULT " + json.dumps({"gpu": pool.use_gpu, "ranks": poll["ranks"], "strategy": table["strategy"],
                              "bundles": table["bundles"], "follower": follower, "state": state}))
"""


@pytest.mark.slow  # a private Ray in a child process, as tests/runtime/test_cluster.py
def test_a_gpu_group_places_one_gpu_per_rank_on_one_node_and_is_removed_whole():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, MODEL, str(random_model())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["gpu"] and out["strategy"] == "STRICT_PACK"
    assert list(out["bundles"].values()) == [{"GPU": 1.0, "CPU": 1.0}] * 2
    ranks = out["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["weight_bytes"] > 0 for r in ranks)
    assert sorted(g for r in ranks for g in r["gpus"]) == ["0", "1"]  # one GPU each, not shared
    assert len({r["node"] for r in ranks}) == 1 and ranks[0]["pid"] != ranks[1]["pid"]
    assert (out["follower"], out["state"]) == ("dead", "REMOVED")


def test_every_rank_of_a_placed_group_uses_the_one_gpu_it_sees():
    launcher = FollowerLauncher([])
    assert [launcher.device("cuda", r) for r in range(4)] == ["cuda:0"] * 4
    assert launcher.device("cpu", 1) == "cpu"
