"""Cluster placement and joining: a simulated multi-node Ray cluster, and a token-protected head."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.service.conftest import SAMPLES, free_port

pytestmark = pytest.mark.slow

PLACEMENT = textwrap.dedent('''
    import collections, json, sys
    import ray
    from ray.cluster_utils import Cluster
    from bulkgen.runtime.pool import WorkerPool
    from bulkgen.settings import WorkerSettings

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
    for _ in range(2):   # two "GPU nodes": Ray schedules on the declared GPUs; the engine runs on CPU here
        cluster.add_node(num_cpus=2, num_gpus=2, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="bulkgen")
    pool = WorkerPool(WorkerSettings(ray_address=cluster.address, cpu_threads=1))
    workers = pool.start()
    infos = ray.get([w.load.remote("bulkgen-tiny", sys.argv[2]) for w in workers])
    print(json.dumps({"gpu": pool.use_gpu, "nodes": collections.Counter(i["node"] for i in infos),
                      "devices": sorted({i["device"] for i in infos}), "count": len(infos)}))
    pool.shutdown()
    ray.shutdown()
    cluster.shutdown()
''')


def test_one_actor_per_declared_gpu_spread_over_the_nodes(tmp_path):
    import json

    out = subprocess.run([sys.executable, "-c", PLACEMENT, str(tmp_path / "store"), str(SAMPLES / "model")],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["gpu"] and result["count"] == 4
    assert sorted(result["nodes"].values()) == [2, 2]   # two nodes, two actors (GPUs) each
    assert result["devices"] == ["cpu"]


def test_joining_a_token_protected_head_by_address(tmp_path):
    """Ray 2.5x+: `ray start --head` enables token auth when a token exists; a client given an explicit
    address must then run in token mode, which bulkgen turns on when it finds the token."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("bulkgen-test-token-0123456789abcdef")
    port = free_port()
    env = {**os.environ, "HOME": str(home)}
    env.pop("RAY_AUTH_MODE", None)
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(["ray", "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                             f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                             f"--temp-dir={tmp_path / 'ray'}"],
                            env={**env, "RAY_AUTH_MODE": "token"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        join = ("import ray; from bulkgen.runtime.pool import init_ray; "
                f"init_ray('127.0.0.1:{port}'); print('CPUS', ray.cluster_resources().get('CPU'))")
        deadline, out = time.monotonic() + 90, None
        while time.monotonic() < deadline:
            out = subprocess.run([sys.executable, "-c", join], env=env, capture_output=True, text=True, timeout=60)
            if "CPUS" in out.stdout:
                break
            time.sleep(2)
        assert out is not None and "CPUS 1.0" in out.stdout, (out.stdout + out.stderr)[-3000:]
    finally:
        os.killpg(head.pid, 9)
        head.wait(30)
