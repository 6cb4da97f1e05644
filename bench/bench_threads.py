"""The machine's own ceiling for N CPU workers: the bare engine, no Ray, no storage, no driver.

Three layouts on bench_runtime's requests (greedy, the bundled model):
- 1 process x 1 torch thread, all requests;
- 1 process x C torch threads (C = cores), all requests: what one worker with every core gets;
- C processes x 1 torch thread, each 1/C of the requests, started together: what C workers get.
If the last over the second is already under 1.8x here, the runtime cannot reach it either: the
shortfall is the machine's (intra-op threads that scale well, shared caches, memory bandwidth).

    python bench/bench_threads.py [--requests 600]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_runtime import workload  # noqa: E402


def _child(path: Path, threads: int, part: int, parts: int, start_at: float, args) -> None:
    import torch

    torch.set_num_threads(threads)
    from bulkgen.batch.prepare import fit_context, tokenize
    from bulkgen.batch.requests import parse_line
    from bulkgen.engine import Engine, SamplingParams
    from bulkgen.models.registry import default_model_path

    engine = Engine.from_pretrained(
        default_model_path(),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=4))
    lines = path.read_bytes().splitlines()[part::parts]
    time.sleep(max(0.0, start_at - time.time()))  # every process starts generating at once
    t0 = time.perf_counter()
    requests = [parse_line(raw, n, "/v1/completions") for n, raw in enumerate(lines, 1)]
    prompts, params = [], []
    for r in requests:
        ids = tokenize(r, engine.tokenizer)
        prompts.append(ids)
        params.append(SamplingParams(**fit_context(r, len(ids), engine.max_model_len)))
    steps0, busy0 = engine.stats_.counters["steps"], engine.stats_.counters["busy_time_s"]
    cpu0 = time.process_time()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    c = engine.stats_.counters
    tokens = sum(len(x.token_ids) for o in outs for x in o.outputs)
    print(
        "RESULT "
        + json.dumps(
            {
                "wall_s": wall,
                "tokens": tokens,
                "steps": c["steps"] - steps0,
                "cpu_s": cpu,
                "step_ms": 1000 * (c["busy_time_s"] - busy0) / max(1, c["steps"] - steps0),
            }
        )
    )


def _layout(path: Path, processes: int, threads: int, args) -> dict:
    from cpu_account import CpuAccount

    start_at = time.time() + 25.0  # after every process has loaded its model
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                str(path),
                str(threads),
                str(k),
                str(processes),
                str(start_at),
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for k in range(processes)
    ]
    results = []
    with CpuAccount() as account:
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            results.append(
                json.loads(
                    next(x for x in out.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT ")
                )
            )
    wall = max(r["wall_s"] for r in results)
    others = account.window(start_at, start_at + wall).get("not this run", 0.0)
    tokens = sum(r["tokens"] for r in results)
    return {
        "layout": f"{processes} proc x {threads} thread",
        "wall_s": wall,
        "tokens": tokens,
        "tok_per_s": tokens / wall,
        "step_ms": [round(r["step_ms"], 1) for r in results],
        "steps": [r["steps"] for r in results],
        "cpu_s": [round(r["cpu_s"], 2) for r in results],
        "others_cpu_s": others,
        "load": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument(
        "--single-thread-only",
        action="store_true",
        help="skip 1 process x C threads (an OpenMP "
        "team on a loaded machine waits for descheduled threads at every barrier: minutes)",
    )
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, threads, part, parts, start_at = args.child
        return _child(Path(path), int(threads), int(part), int(parts), float(start_at), args)
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        path = workload(Path(tmp) / "requests.jsonl", args.requests)
        layouts = [(1, 1), (cores, 1)] if args.single_thread_only else [(1, 1), (1, cores), (cores, 1)]
        rows = [_layout(path, procs, threads, args) for procs, threads in layouts]
    for r in rows:
        print(
            f"{r['layout']:>20}: {r['wall_s']:.2f} s, {r['tokens']} tokens, {r['tok_per_s']:.0f} tok/s, "
            f"steps {r['steps']}, step ms {r['step_ms']}, CPU s {r['cpu_s']} "
            f"({1000 * sum(r['cpu_s']) / sum(r['steps']):.1f} CPU ms a step); "
            f"other processes' CPU s meanwhile {r['others_cpu_s']:.1f}, load {r['load'][0]:.2f}"
        )
    print(
        f"{cores} processes x 1 thread vs 1 x 1: {rows[-1]['tok_per_s'] / rows[0]['tok_per_s']:.2f}x, in steps of the "
        f"slowest process {rows[0]['steps'][0] / max(rows[-1]['steps']):.2f}x"
    )
    if len(rows) == 3:
        print(
            f"{cores} threads in one process vs 1: {rows[1]['tok_per_s'] / rows[0]['tok_per_s']:.2f}x; "
            f"{cores} processes x 1 thread vs 1 process x {cores} threads: "
            f"{rows[2]['tok_per_s'] / rows[1]['tok_per_s']:.2f}x (the ceiling for {cores} workers vs 1)"
        )


if __name__ == "__main__":
    main()
