"""A GPU group's placement without GPUs: a private local Ray that declares two GPUs (Ray hands them out by
id and sets each actor's CUDA_VISIBLE_DEVICES; nothing here touches CUDA) places a two-rank group. Each
rank gets a bundle of its own GPU on one node, the launcher gives every rank cuda:0 (the only device its
process sees), the dashboard's rank table names both GPUs, and removing the group ends its follower and
its placement group. It runs in a child process, since this process's Ray (shared by the suite) has no
GPUs and one process holds one Ray."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, os, ray
from ray.util.placement_group import placement_group_table
from bulkgen.runtime.groups import place, placement_of_this_process

ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
         configure_logging=False, object_store_memory=80 * 1024 * 1024, _node_ip_address="127.0.0.1")

@ray.remote
class Rank0:
    def __init__(self, launcher):
        self.launcher = launcher

    def report(self):
        table = self.launcher.ranks([{"rank": 0}, {"rank": 1}])
        env = [os.environ.get("CUDA_VISIBLE_DEVICES")]
        return {"ranks": table, "devices": [self.launcher.device("cuda", r) for r in (0, 1)], "env": env}

group = place("g", "test", 2, True, 1.0, lambda options, launcher: Rank0.options(**options).remote(launcher))
out = ray.get(group.worker.report.remote(), timeout=120)
group.remove()
try:
    ray.get(group.followers[0].where.remote(), timeout=60)
    out["follower"] = "alive"
except ray.exceptions.RayActorError:
    out["follower"] = "dead"
out["state"] = placement_group_table(group.placement)["state"]
out["strategy"] = placement_group_table(group.placement)["strategy"]
print("RESULT " + json.dumps(out))
"""


def test_a_gpu_group_places_one_gpu_per_rank_on_one_node_and_is_removed_whole():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    ranks = out["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sorted(g for r in ranks for g in r["gpus"]) == ["0", "1"]  # one GPU each, not shared
    assert all(len(r["gpus"]) == 1 for r in ranks) and out["env"] == [ranks[0]["gpus"][0]]
    assert len({r["node"] for r in ranks}) == 1 and ranks[0]["pid"] != ranks[1]["pid"]
    assert out["devices"] == ["cuda:0", "cuda:0"]
    assert out["strategy"] == "STRICT_PACK"
    assert (out["follower"], out["state"]) == ("dead", "REMOVED")
