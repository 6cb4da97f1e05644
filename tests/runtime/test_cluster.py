"""Cluster placement and joining: a simulated multi-node Ray cluster, and a token-protected head."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.support.service import random_model

pytestmark = pytest.mark.slow

# Ray rewrites 127.0.0.1 in a cluster address to the host's own IP; tests here may only use loopback,
# so the scripts keep the address as given (the cluster is bound to 127.0.0.1 alone).
KEEP_LOOPBACK = "import ray._private.services as _s; _s.resolve_ip_for_localhost = lambda host: host\n"

PLACEMENT = KEEP_LOOPBACK + textwrap.dedent("""
    import collections, json, sys
    import ray
    from ray.cluster_utils import Cluster
    from bulkgen.runtime.pool import WorkerPool
    from bulkgen.settings import WorkerSettings

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
    for _ in range(2):   # two "GPU nodes": Ray schedules on the declared GPUs; the engine runs on CPU here
        cluster.add_node(num_cpus=2, num_gpus=2, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    pool = WorkerPool(WorkerSettings(ray_address=cluster.address, cpu_threads=1))
    workers = pool.start()
    infos = ray.get([w.load.remote("bulkgen-tiny", sys.argv[2]) for w in workers])
    print(json.dumps({"gpu": pool.use_gpu, "nodes": collections.Counter(i["node"] for i in infos),
                      "devices": sorted({i["device"] for i in infos}), "count": len(infos)}))
    pool.shutdown()
    ray.shutdown()
    cluster.shutdown()
""")


def test_one_actor_per_declared_gpu_spread_over_the_nodes(tmp_path):
    import json

    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # this test cluster runs without token auth
    out = subprocess.run(
        [sys.executable, "-c", PLACEMENT, str(tmp_path / "store"), str(random_model())],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["gpu"] and result["count"] == 4
    assert sorted(result["nodes"].values()) == [2, 2]  # two nodes, two actors (GPUs) each
    assert result["devices"] == ["cpu"]


def test_joining_by_address_turns_token_auth_on_when_a_token_exists(tmp_path):
    """Ray 2.5x+: `ray start --head` enables token auth when a token exists, but a client given an
    explicit address sends it only in token mode; bulkgen turns that mode on when it finds the token,
    and leaves an explicit RAY_AUTH_MODE alone. (A live join of a token head is not run here: on this
    loopback-only sandbox a driver could not attach to a `ray start` head at all, token or not.)"""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    probe = (
        "import os; from bulkgen.runtime.pool import _use_token_auth_if_available as f; f(); "
        "print(os.environ.get('RAY_AUTH_MODE'))"
    )

    def mode(**env: str) -> str:
        clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        out = subprocess.run(
            [sys.executable, "-c", probe],
            env={**clean, "HOME": str(home), **env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert mode() == "None"  # no token anywhere: nothing changes
    (home / ".ray" / "auth_token").write_text("bulkgen-test-token")
    assert mode() == "token"  # ~/.ray/auth_token, as `ray start` leaves it
    assert mode(RAY_AUTH_MODE="disabled") == "disabled"  # an explicit choice wins
    (home / ".ray" / "auth_token").unlink()
    assert mode(RAY_AUTH_TOKEN="abc") == "token"
