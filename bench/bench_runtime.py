"""What the runtime costs, and what a second worker buys, measured in one run.

Three configurations on the same requests (greedy, so every run generates the same tokens):
- engine: bulkgen's `Engine.generate` in one process: parse, tokenize, generate (no Ray, no storage);
- run, 1 worker: the whole `bulkgen run` path (storage records, validation, line index, work queue,
  a Ray worker actor that reads, tokenizes and writes parts, finalize), one CPU worker with every core;
- run, 2 workers: the same with two CPU workers sharing the cores.
Each runs in its own process (Ray starts once per process). For the service runs, `generate s` is the
batch's own first-arrival-to-last-finish time from its metrics, `fixed s` the rest of `total s` (Ray
start, model load, validation, finalize), and `step ms` the engine's mean step time as the worker
reports it (the engine's own counters for the bare engine); each worker also reports its engine's whole
steps itself (`step_time` of its polls, shown in /v1/dashboard/workers: count, mean, p50, p90 ms), printed
beside the same measure of the bare engine (its warm-up steps left out; a worker's first, cold steps
count). The CPU account (bench/cpu_account.py) shows where the machine's CPU time went during generation: the worker's threads, the driver, Ray's
daemons and anything else running (which says whether the machine was quiet). Goals: the runtime
costs under 10% of the engine's wall time, a step in the worker within 5% of a step alone, and two
workers at least 1.8x one.

    python bench/bench_runtime.py [--requests 600] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = (
    "the data batch model token cache queue worker prompt result slot stream range part lease "
    "engine offline bulk label summary review answer question detail"
).split()


def workload(path: Path, count: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(count):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
            body = {
                "model": "bulkgen-tiny",
                "prompt": prompt,
                "max_tokens": rng.randint(8, 32),
                "temperature": 0,
            }
            f.write(
                json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
                + "\n"
            )
    return path


def run_engine(path: Path, engine_kwargs: dict) -> dict:
    from bulkgen.batch.prepare import fit_context, tokenize
    from bulkgen.batch.requests import parse_line
    from bulkgen.engine import Engine, SamplingParams
    from bulkgen.engine.stats import StepTimes
    from bulkgen.models.registry import default_model_path

    engine = Engine.from_pretrained(default_model_path(), **engine_kwargs)
    engine.generate(
        [[1, 2, 3]] * 4, SamplingParams(max_tokens=4)
    )  # warm-up, as the service's first steps are
    engine.pop_step_records()  # the warm-up's steps are not counted
    start = time.perf_counter()  # parsing and tokenizing count: a user of the engine does them too
    requests = [
        parse_line(raw, n, "/v1/completions") for n, raw in enumerate(path.read_bytes().splitlines(), 1)
    ]
    prompts, params = [], []
    for r in requests:
        ids = tokenize(r, engine.tokenizer)
        prompts.append(ids)
        params.append(SamplingParams(**fit_context(r, len(ids), engine.max_model_len)))
    steps_before = dict(engine.stats_.counters)
    t0 = time.time()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    c = engine.stats_.counters
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    steps = c["steps"] - steps_before["steps"]
    step_ms = 1000 * (c["busy_time_s"] - steps_before["busy_time_s"]) / max(1, steps)
    step_times = StepTimes()  # the same measure a worker reports (`step_time` of its polls)
    for record in engine.pop_step_records():
        step_times.add(record["duration_s"])
    return {
        "config": "engine",
        "generate_s": wall,
        "total_s": wall,
        "fixed_s": 0.0,
        "output_tokens": tokens,
        "steps": steps,
        "step_ms": step_ms,
        "step_time": [step_times.summary()],
        "window": (t0, time.time()),
    }


def run_service(path: Path, workers: int, engine_kwargs: dict) -> dict:
    from bulkgen.batch.service import BatchService
    from bulkgen.runtime.driver import Driver
    from bulkgen.settings import Settings, WorkerSettings
    from bulkgen.store import layout

    with tempfile.TemporaryDirectory() as storage:
        settings = Settings(
            storage=storage, workers=WorkerSettings(cpu_workers=workers, engine_kwargs=engine_kwargs)
        )
        svc = BatchService(settings)
        start = time.perf_counter()
        with path.open("rb") as f:
            record = Driver(svc).run(f, path.name, "/v1/completions", "24h")
        total = time.perf_counter() - start
        state = json.loads(svc.store.read_bytes(layout.metrics_state(record.id)))
        step_time = worker_step_times(workers)
    metrics = record.metrics
    per_worker = metrics["per_worker"].values()
    steps = sum(w["steps"] for w in per_worker)
    first, last = state["first_arrival"], state["last_finish"]
    return {
        "config": f"run, {workers} worker{'s' if workers > 1 else ''}",
        "generate_s": metrics["wall_time_s"],
        "total_s": total,
        "fixed_s": total - metrics["wall_time_s"],
        "output_tokens": metrics["output_tokens"],
        "status": record.status,
        "steps": steps,
        "step_time": step_time,
        "step_ms": 1000 * sum(w["busy_time_s"] for w in per_worker) / max(1, steps),
        "window": (first, last),
    }


def worker_step_times(count: int) -> list[dict]:
    """Each worker's own report of its engine's steps (`step_time` of a poll: count, mean, p50, p90 ms).
    `bulkgen run` leaves its workers running, so they answer after the batch."""
    import ray

    from bulkgen.runtime.pool import NAMESPACE

    handles = [ray.get_actor(f"bulkgen-worker-{i}", namespace=NAMESPACE) for i in range(count)]
    return [poll["step_time"] for poll in ray.get([h.poll.remote("bench", 0.0, False) for h in handles])]


def _child(args) -> None:
    from cpu_account import CpuAccount

    kwargs = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    path = Path(args.file)
    with CpuAccount() as account:
        result = (
            run_engine(path, kwargs) if args.one == "engine" else run_service(path, int(args.one), kwargs)
        )
    result["cpu_s"] = account.window(*result.pop("window"))
    result["load"] = os.getloadavg()
    print("RESULT " + json.dumps(result))


def _measure(config: str, path: Path, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--one",
        config,
        "--file",
        str(path),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{config} failed:\n{out.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        return _child(args)
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = workload(Path(tmp) / "requests.jsonl", args.requests)
        rows = [_measure(c, path, args) for c in ("engine", "1", "2")]
    base = rows[0]
    for row in rows:
        row["tok_per_s"] = row["output_tokens"] / row["generate_s"]
        row["overhead_vs_engine"] = row["generate_s"] / base["generate_s"] - 1
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    from bulkgen.metrics.table import text_table

    table = [
        [
            "config",
            "generate s",
            "fixed s",
            "total s",
            "out tokens",
            "out tok/s",
            "steps",
            "step ms",
            "vs engine",
        ]
    ]
    table += [
        [
            r["config"],
            f"{r['generate_s']:.2f}",
            f"{r['fixed_s']:.2f}",
            f"{r['total_s']:.2f}",
            str(r["output_tokens"]),
            f"{r['tok_per_s']:.0f}",
            str(r["steps"]),
            f"{r['step_ms']:.1f}",
            f"{r['overhead_vs_engine']:+.1%}",
        ]
        for r in rows
    ]
    print(text_table(table))
    print(
        "\nEngine step wall time as each engine reports it (steps, mean / p50 / p90 ms), vs the bare engine's:"
    )
    bare = base["step_time"][0]
    for r in rows:
        for k, st in enumerate(r["step_time"]):
            who = "bare engine" if r is base else f"{r['config']}, worker {k}"
            print(
                f"  {who}: {st['steps']} steps, {st['mean_ms']:.1f} / {st['p50_ms']:.1f} / {st['p90_ms']:.1f} ms"
                + (
                    ""
                    if r is base
                    else f"; vs bare: mean {st['mean_ms'] / bare['mean_ms']:.2f}x, "
                    f"p50 {st['p50_ms'] / bare['p50_ms']:.2f}x"
                )
            )
    print("\nCPU seconds during generation (first arrival to last finish), by process and worker thread:")
    for r in rows:
        print(f"  {r['config']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_s"].items()))
    print(
        f"\n{args.requests} requests, greedy, max_num_seqs {args.max_num_seqs}, {os.cpu_count()} cores; "
        f"runtime cost (1 worker): {rows[1]['overhead_vs_engine']:+.1%} of the engine's time (goal < +10%); "
        f"step time in the worker vs alone (worker's own report, mean): "
        f"{rows[1]['step_time'][0]['mean_ms'] / bare['mean_ms']:.2f}x (goal <= 1.05x); "
        f"2 workers vs 1: {rows[1]['generate_s'] / rows[2]['generate_s']:.2f}x (goal >= 1.8x); "
        f"1-min load average at the start {load0[0]:.2f}, after each config "
        + " / ".join(f"{r['load'][0]:.2f}" for r in rows)
    )


if __name__ == "__main__":
    main()
