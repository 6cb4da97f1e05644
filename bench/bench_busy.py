"""Does the dispatcher keep every worker busy until the tail? A simulated 4-GPU cluster, engines on CPU.

`ray.cluster_utils.Cluster` starts a head and N nodes with one fake GPU each, so the pool makes one
GPU worker actor per node (Ray schedules on the declared GPUs; the engines run on CPU with one torch
thread each). A warm-up batch loads the model on every worker; then one batch of short requests
(the bundled model, small max_tokens) goes through the whole `bulkgen run` path (`Driver.run`).

Measured, from every engine step the workers report (whole steps: this is the only batch):
- start: the moment the batch's ranges entered the work queue;
- tail: the moment the queue had no unassigned range left (after it, idle workers are the tail's);
- busy share of a worker: its step time inside [start, tail] over (tail - start). Goal: >= 95% each.
The idle rest is split into the wait before the worker's first step (assignment latency), gaps
between steps of up to 5 ms (the engine's own work between timed steps: scheduling, admission,
the worker's bookkeeping), and longer gaps (the worker ran out of work or the host starved it); the
fewest requests a worker held at any poll between its first step and the tail tells which (0: the
dispatcher let it run dry).
On a machine with fewer cores than workers the engines share cores: their steps are slower, but a
worker that is stepping is busy; the CPU account says what else ran.

    python bench/bench_busy.py [--nodes 4] [--requests 2000] [--max-tokens 8] [--max-num-seqs 32]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHORT_GAP_S = 0.005
WORDS = "the data batch model token cache queue worker prompt result slot range part lease engine".split()


def workload(path: Path, count: int, max_tokens: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(count):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
            body = {
                "model": "bulkgen-tiny",
                "prompt": prompt,
                "max_tokens": rng.randint(1, max_tokens),
                "temperature": 0,
            }
            f.write(
                json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
                + "\n"
            )
    return path


class Recorder:
    """Hooks on the driver's side (bench only): step records by worker, when the batch was queued,
    and every take (when, which worker, how many requests, how many were left)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: dict[str, list[tuple[float, float, int]]] = {}  # worker -> (start, end, slots)
        self.queued_at: float | None = None
        self.tail_at: float | None = None
        self.takes: list[tuple[float, int, int, int]] = []
        self.held: dict[str, list[tuple[float, int]]] = {}  # worker -> (poll answered, requests it held)

    def install(self) -> None:
        from bulkgen.runtime import dispatch, runner, workqueue

        recorder = self
        add_steps, add_batch, take = (
            runner.BatchRunner.add_steps,
            workqueue.WorkQueue.add_batch,
            workqueue.WorkQueue.take,
        )

        def on_steps(self, worker, records):
            with recorder.lock:
                recorder.steps.setdefault(worker, []).extend(
                    (r["t"] - r["duration_s"], r["t"], r.get("batch_size", r["num_seqs"])) for r in records
                )
            return add_steps(self, worker, records)

        route = dispatch.Dispatcher._route

        def on_route(self, index, poll):
            with recorder.lock:
                recorder.held.setdefault(f"bulkgen-worker-{index}", []).append((time.time(), poll["held"]))
            return route(self, index, poll)

        dispatch.Dispatcher._route = on_route

        def on_add(self, job, index, ranges):
            out = add_batch(self, job, index, ranges)
            if len(index) > 1 and recorder.queued_at is None and ranges:
                recorder.queued_at = time.time()
            return out

        def on_take(self, worker, want, *args, **kwargs):
            taken = take(self, worker, want, *args, **kwargs)
            if taken and recorder.queued_at is not None:
                left = self.pending_requests()
                recorder.takes.append((time.time(), worker, sum(r.size for r in taken), left))
                if left == 0 and recorder.tail_at is None:
                    recorder.tail_at = time.time()
            return taken

        runner.BatchRunner.add_steps, workqueue.WorkQueue.add_batch, workqueue.WorkQueue.take = (
            on_steps,
            on_add,
            on_take,
        )

    def shares(self) -> dict[str, dict]:
        start, tail = self.queued_at, self.tail_at
        window = tail - start
        out = {}
        for worker, steps in sorted(self.steps.items()):
            steps = sorted(steps)
            inside = [(max(a, start), min(b, tail)) for a, b, _ in steps if b > start and a < tail]
            busy = sum(b - a for a, b in inside)
            first = inside[0][0] if inside else tail
            gaps = [b[0] - a[1] for a, b in zip(inside, inside[1:], strict=False)]
            last_end = inside[-1][1] if inside else tail
            out[worker] = {
                "busy_share": busy / window,
                "steps": len(inside),
                "first_step_after_s": first - start,
                "short_gaps_s": sum(g for g in gaps if g <= SHORT_GAP_S),
                "long_gaps_s": sum(g for g in gaps if g > SHORT_GAP_S) + (tail - last_end),
                "longest_gap_s": max([*gaps, tail - last_end, 0.0]),
                "mean_slots": sum(s for _, _, s in steps) / max(1, len(steps)),
                "min_held": min((n for t, n in self.held.get(worker, []) if first < t < tail), default=None),
            }
        return out


def cluster(nodes: int):
    import ray._private.services as services
    from ray.cluster_utils import Cluster

    services.resolve_ip_for_localhost = lambda host: host  # loopback only: keep 127.0.0.1 as given
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
    for _ in range(nodes):
        c.add_node(num_cpus=1, num_gpus=1, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    return c


def loaded(svc, count: int) -> None:
    """Wait until every worker holds the model (a load under way is waited for, never repeated)."""
    import ray

    from bulkgen.runtime.pool import NAMESPACE

    ((name, path),) = svc.settings.models.items()
    handles = [ray.get_actor(f"bulkgen-worker-{i}", namespace=NAMESPACE) for i in range(count)]
    ray.get([h.load.remote(name, path) for h in handles], timeout=600)


def run(args) -> dict:
    from cpu_account import CpuAccount

    from bulkgen.batch.service import BatchService
    from bulkgen.runtime.driver import Driver
    from bulkgen.settings import Settings, WorkerSettings

    c = cluster(args.nodes)
    recorder = Recorder()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            engine = {"max_num_seqs": args.max_num_seqs}
            workers = WorkerSettings(
                ray_address=c.address, cpu_threads=1, engine_kwargs=engine, poll_deadline_s=120.0
            )
            svc = BatchService(Settings(storage=f"{tmp}/store", workers=workers, range_size=args.range_size))
            warm = workload(Path(tmp) / "warm.jsonl", 4 * args.nodes, 2, seed=1)
            with warm.open("rb") as f:  # loads the model on every worker (they outlive a run)
                Driver(svc).run(f, warm.name, "/v1/completions", "24h")
            loaded(svc, args.nodes)
            path = workload(Path(tmp) / "requests.jsonl", args.requests, args.max_tokens)
            recorder.install()
            load0 = os.getloadavg()
            with CpuAccount() as account, path.open("rb") as f:
                record = Driver(svc).run(f, path.name, "/v1/completions", "24h")
            cpu = account.window(recorder.queued_at, recorder.tail_at or time.time())
    finally:
        import ray

        ray.shutdown()
        c.shutdown()
    return {
        "status": record.status,
        "wall_time_s": record.metrics["wall_time_s"],
        "window_s": (recorder.tail_at or 0) - (recorder.queued_at or 0),
        "shares": recorder.shares(),
        "takes": len(recorder.takes),
        "cpu_s": cpu,
        "load": [load0[0], os.getloadavg()[0]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--range-size", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # the simulated cluster runs without token auth
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{args.requests} requests (max_tokens <= {args.max_tokens}) on {args.nodes} simulated GPU nodes, "
        f"max_num_seqs {args.max_num_seqs}, range size {args.range_size}: {result['status']}, generation "
        f"{result['wall_time_s']:.2f} s; queued -> tail {result['window_s']:.2f} s, {result['takes']} takes"
    )
    ok = True
    for worker, s in result["shares"].items():
        ok &= s["busy_share"] >= 0.95
        print(
            f"  {worker}: busy {s['busy_share']:.1%} ({s['steps']} steps, {s['mean_slots']:.1f} slots/step); "
            f"idle: before first step {s['first_step_after_s'] * 1000:.0f} ms, gaps <= 5 ms "
            f"{s['short_gaps_s'] * 1000:.0f} ms, longer gaps {s['long_gaps_s'] * 1000:.0f} ms "
            f"(longest {s['longest_gap_s'] * 1000:.0f} ms); fewest requests it held at a poll after its "
            f"first step: {s['min_held']}"
        )
    print(
        f"every worker busy >= 95% until the tail: {'yes' if ok and result['shares'] else 'NO'}; "
        f"{os.cpu_count()} cores, 1-min load average before / after {result['load'][0]:.2f} / "
        f"{result['load'][1]:.2f}"
    )
    print("CPU seconds queued -> tail: " + ", ".join(f"{k} {v:.1f}" for k, v in result["cpu_s"].items()))


if __name__ == "__main__":
    main()
