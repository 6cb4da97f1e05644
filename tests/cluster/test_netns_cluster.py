"""bulkgen on a real three-node Ray cluster in network namespaces: spread, node death, partition, the
node's return, a driver that joins from a host that was no Ray node, and the head's death.

The scenarios share one cluster (tests/cluster/conftest.py) and run in this order; each asserts every
custom_id exactly once and final counts that match the files, and the fault scenarios also that the
live counts never passed the total. Detection and recovery times are printed (`cluster timing ...`).
"""

from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime

import pytest

from tests.cluster.conftest import STORAGE, TERMINAL, Cluster
from tests.cluster.rig import GCS, HEAD_IP, IP, PORTS, S3_IP
from tests.support.parts import envelopes
from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]  # the first one brings the cluster up

NODE_IP = {"a": IP["a"], "b": IP["b"]}
FAULT_REQUESTS = 800  # about 6 s of work for the two tiny CPU engines on a quiet machine


def rows(prefix: str, n: int, max_tokens: int) -> list[dict]:
    """Requests of eight lengths up to `max_tokens`: with one length, an engine's whole batch would end in
    one wave and a batch could go from 10 % to done between two looks, leaving no work for a fault."""
    topics = [
        "the camera tab crashes",
        "I was billed twice",
        "my parcel is late",
        "great support",
        "add dark mode",
    ]
    return [
        {
            "custom_id": f"{prefix}-{i:04d}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "bulkgen-tiny",
                "max_tokens": max(4, max_tokens * (i % 8 + 1) // 8),
                "temperature": 0.9,
                "seed": i,
                "messages": [
                    {"role": "user", "content": f"Label this ({i}): {topics[i % 5]}" + " more" * (i % 7)}
                ],
            },
        }
        for i in range(n)
    ]


class Watch:
    """Follows a batch; remembers the most requests it ever saw settled (never above the total)."""

    def __init__(self, cluster: Cluster, batch_id: str) -> None:
        self.cluster, self.batch_id, self.most, self.total = cluster, batch_id, 0, 0

    def look(self):
        b = self.cluster.batch(self.batch_id)
        if b is not None:
            self.total = b.request_counts.total
            self.most = max(self.most, b.request_counts.completed + b.request_counts.failed)
        return b

    def until(self, what: str, predicate, timeout: float):
        return wait_until(
            lambda: (b := self.look()) is not None and predicate(b) and b, timeout, what, interval=0.2
        )

    def ended(self, timeout: float = 300):
        return self.until(f"batch {self.batch_id} ended", lambda b: b.status in TERMINAL, timeout)


def assert_exactly_once(cluster: Cluster, batch, sent: list[dict], watch: Watch | None = None) -> list[dict]:
    assert batch.status == "completed", (batch.status, batch.errors)
    out, err = cluster.results(batch)
    ids = [x["custom_id"] for x in out + err]
    want = [r["custom_id"] for r in sent]
    assert sorted(ids) == sorted(want), (
        f"{len(ids)} lines for {len(want)} requests, {len(ids) - len(set(ids))} twice"
    )
    assert [x["custom_id"] for x in out] == [
        i for i in want if i in {x["custom_id"] for x in out}
    ]  # input order
    assert not err, err[:1]
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(out), len(err))
    if watch is not None:
        assert watch.most <= watch.total, f"live counts reached {watch.most} of {watch.total}"
    return out


def steps_per_worker(batch) -> dict[str, int]:
    per_worker = ((batch.model_extra or {}).get("metrics") or {}).get("per_worker") or {}
    return {name: w.get("steps", 0) for name, w in per_worker.items()}


def worker_on(cluster: Cluster, node: str) -> int:
    found = [i for i, ip in cluster.workers().items() if ip == NODE_IP[node]]
    assert found, f"no worker on node {node}: {cluster.workers()}"
    return found[0]


def replaced_on(cluster: Cluster, index: int, node: str, mark: int) -> None:
    """Wait for the service to log worker `index` replaced (after log character `mark`) and for the
    replacement to report `node`'s address."""
    wait_until(
        lambda: cluster.log_line(rf"worker {index} replaced", mark),
        180,
        f"worker {index} replaced",
        interval=0.2,
    )
    wait_until(
        lambda: cluster.workers().get(index) == NODE_IP[node],
        60,
        f"the replacement reports node {node}",
        interval=0.2,
    )


def fault_mid_batch(cluster: Cluster, name: str, index: int, fault, after: float) -> tuple:
    """Run a batch, apply `fault` at >= `after` of it, follow it to its end -> (batch, sent, watch, notice s,
    done s): when the service logged the worker lost, and when the batch was seen completed."""
    sent = rows(name, FAULT_REQUESTS, 96)
    watch = Watch(cluster, cluster.submit(sent, name).id)

    def hit(b) -> bool:  # `after` of the batch done, and the worker to be hit holds some of the rest
        return b.request_counts.completed >= after * len(sent) and cluster.in_flight(index, b.id) > 0

    before = watch.until(f"{name}: {after:.0%} done, worker {index} holding some", hit, 300)
    # what matters is that work is left for the fault to hit
    assert before.status == "in_progress" and before.request_counts.completed < len(sent), (
        before.request_counts
    )
    mark, t_fault, wall = len(cluster.serve_log()), time.monotonic(), datetime.now()
    fault()
    seen = wait_until(
        lambda: watch.look() and cluster.log_line(rf"worker {index} .*lost", mark),
        120,
        f"{name}: worker {index} reported lost",
        interval=0.2,
    )
    batch = watch.ended()
    done = time.monotonic() - t_fault
    return batch, sent, watch, (seen[0] - wall).total_seconds(), done


def test_a_batch_from_the_client_namespace_spreads_over_both_nodes(cluster):
    """`bulkgen serve --ray-address` on the head, the openai client in bgt-cli: one worker per fake GPU,
    one on each node, and both do work."""
    wait_until(
        lambda: sorted(map(str, cluster.workers().values())) == sorted(NODE_IP.values()),
        120,
        "a worker on each node",
        interval=0.2,
    )
    sent = rows("spread", 300, 48)
    t0 = time.monotonic()
    watch = Watch(cluster, cluster.submit(sent, "spread").id)
    batch = watch.ended()
    cluster.timing("spread_batch", time.monotonic() - t0)
    assert_exactly_once(cluster, batch, sent, watch)
    steps = steps_per_worker(batch)
    assert len(steps) == 2 and all(steps.values()), steps


def test_a_node_killed_mid_batch(cluster):
    index = worker_on(cluster, "a")
    batch, sent, watch, notice, done = fault_mid_batch(
        cluster, "kill", index, lambda: cluster.rig.kill("ray-a"), 0.05
    )
    cluster.timing("node_kill_detected", notice)
    cluster.timing("node_kill_to_batch_done", done)
    assert_exactly_once(cluster, batch, sent, watch)
    cluster.killed_index = index


def test_the_killed_node_returns_and_its_worker_is_used_again(cluster):
    index = cluster.killed_index
    assert index is not None, "the node-kill scenario did not run"
    mark, t0 = len(cluster.serve_log()), time.monotonic()
    cluster.timing("node_a_restart", cluster.rig.node_up("a"))
    replaced_on(cluster, index, "a", mark)
    cluster.timing("node_start_to_worker_replaced", time.monotonic() - t0)
    sent = rows("back", 150, 48)
    watch = Watch(cluster, cluster.submit(sent, "back").id)
    batch = watch.ended()
    assert_exactly_once(cluster, batch, sent, watch)
    assert steps_per_worker(batch).get(f"bulkgen-worker-{index}", 0) > 0, steps_per_worker(batch)


def test_a_partition_mid_batch_then_the_link_back(cluster):
    index = worker_on(cluster, "b")
    batch, sent, watch, notice, done = fault_mid_batch(
        cluster, "cut", index, lambda: cluster.rig.link("b", up=False), 0.05
    )
    cluster.timing("partition_detected", notice)
    cluster.timing("partition_to_batch_done", done)
    assert_exactly_once(cluster, batch, sent, watch)
    # bulkgen gave up on the worker (its poll deadline) before Ray's health checks declare the node dead;
    # the link comes back once they have: its raylet learns it is dead and exits by itself, and node b is
    # started again: the worker is replaced there
    wait_until(lambda: cluster.live_nodes() == 2, 120, "Ray declares node b dead", interval=1.0)
    mark = len(cluster.serve_log())
    cluster.rig.link("b", up=True)
    raylet = cluster.rig.procs["ray-b"]
    wait_until(lambda: raylet.poll() is not None, 90, "node b's raylet, declared dead, exits", interval=0.5)
    t0 = time.monotonic()
    cluster.rig.node_up("b")
    replaced_on(cluster, index, "b", mark)
    cluster.timing("partitioned_node_restart_to_worker_replaced", time.monotonic() - t0)


def test_a_driver_on_a_host_that_is_no_ray_node_joins_as_a_node_without_gpus(cluster):
    """The shape infra/kuberay/bulkgen-watcher.yaml uses: `ray start --address HEAD --num-gpus 0` in the
    driver's own host (here bgt-drv, its own PID namespace), then the driver. Its requests run on the
    GPU workers of nodes a and b, beside the service's batches."""
    rig = cluster.rig
    sent = rows("drv", 100, 32)
    source, out = rig.root / "drv.jsonl", rig.root / "drv.out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in sent))
    start = (
        f"ray start --address={GCS} --node-ip-address={IP['drv']} --num-cpus=0 --num-gpus=0 "
        f"--temp-dir={rig.root}/r-drv --disable-usage-stats {' '.join(PORTS)}"
    )
    join = (  # `ray start` retried as the rig's own (a raylet under load gives up after 15 s)
        f"for attempt in 1 2 3; do {start} && break; ray stop --force; [ $attempt = 3 ] && exit 3; done; "
        f"exec python -m bulkgen run {source} -o {out} --storage {STORAGE} --ray-address {GCS}"
    )
    t0 = time.monotonic()
    proc = rig.spawn("drv", "drv", ["sh", "-c", join])
    try:
        rc = proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        rig.kill("drv")
    cluster.timing("driver_off_cluster_run", time.monotonic() - t0)
    assert rc == 0, rig.log_text("drv")[-3000:]
    ids = [json.loads(line)["custom_id"] for line in out.read_text().splitlines() if line.strip()]
    assert ids == [r["custom_id"] for r in sent]


ORPHAN_WATCH_S = 20.0


def test_the_head_dies_mid_batch_and_head_and_service_restart_from_storage(cluster):
    """SIGKILL of the head's Ray (GCS) and the service with it, mid-batch; the S3 server (another machine
    in a real deployment) lives on. The raylets of nodes a and b outlive the GCS (60 s by default, 150 s
    here) and so do their engine actors: orphans, still holding ranges. They are kept from S3 (a route
    refused at once) until the head and the service have restarted within that window and the batch is
    finalized from storage by the new runner (the head now has a fake GPU, so it has a worker); then S3
    is theirs again, the head's address not (a raylet that reaches a GCS that does not know it exits, and
    its actors with it: the orphans would be gone, not proven harmless). Nothing of theirs may land after the finalize: each drops its parts once its driver
    has been silent for ORPHAN_AFTER_S, and the new runner finalizes only after that."""
    sent = rows("head", FAULT_REQUESTS, 96)
    watch = Watch(cluster, cluster.submit(sent, "head").id)
    batch_id = watch.batch_id
    watch.until(
        "some parts stored", lambda b: b.request_counts.completed >= 48 and cluster.parts(batch_id), 300
    )
    for node in ("a", "b"):
        for address in (HEAD_IP, S3_IP):
            cluster.rig.block(node, address, blocked=True)
    t_kill = time.monotonic()
    cluster.rig.kill("ray-head")  # the service is a process of the head node: it dies too
    at_kill = cluster.parts(batch_id)
    cluster.timing("head_restart", cluster.rig.head_up(gpus=1))
    cluster.timing("serve_restart", cluster.serve())
    assert all(cluster.rig.procs[f"ray-{n}"].poll() is None for n in "ab"), "the orphans' raylets ended early"
    batch = watch.ended()
    cluster.timing("head_kill_to_batch_done", time.monotonic() - t_kill)
    out = assert_exactly_once(cluster, batch, sent)
    assert not cluster.parts(batch_id), "parts left behind by the finalize"
    for node in ("a", "b"):  # the orphans may reach S3 again (not the new head): they must store nothing
        cluster.rig.block(node, S3_IP, blocked=False)

    def dropped(node: str) -> bool:
        return "silent for" in cluster.rig.worker_logs(node)

    # the orphans' storage retries (at most 10 s apart) get ORPHAN_WATCH_S to land anything they still
    # hold: watching for something that must not happen is a window, not a condition
    quiet_until = time.monotonic() + ORPHAN_WATCH_S
    while not cluster.parts(batch_id) and time.monotonic() < quiet_until:
        time.sleep(0.5)
    print(f"orphans that logged a dropped part: {[n for n in 'ab' if dropped(n)]}", flush=True)
    leftover = sorted(cluster.parts(batch_id))
    assert not leftover, f"orphaned workers stored {len(leftover)} parts after the finalize: {leftover[:3]}"
    assert all(cluster.rig.procs[f"ray-{n}"].poll() is None for n in "ab"), "the orphans' raylets ended early"
    final = {json.dumps(x, sort_keys=True) for x in out}
    kept = envelopes(at_kill)
    assert kept and all(json.dumps(e, sort_keys=True) in final for e in kept)  # stored work kept, not redone
    assert len(cluster.keys(f"parts/{batch_id}/runner-")) == 2  # the restarted service's runner took it over
