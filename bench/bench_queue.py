"""The work queue's CPU per line handed out, at 100k, 1M and 10M queued lines (no Ray, no engine).

For each size: batches of `--batch-lines` requests each (50,000: the service's default
`--max-requests-per-batch`, so 10M lines are 200 batches; random work, prefixes shared by ~2,000 lines
each) of two tenants, cut into ranges of 32 (the service's `--range-size` default) and queued; then 8 workers take 128 requests at a time in turn, and what each take got is put back 8 takes
later (as a lost worker's ranges come back), so every call sees the queue at its size; after each take
`pending_requests()` is read, as the driver's /metrics does.
The CPU seconds of those calls (process time: the queue runs under one lock, so its CPU is what every
worker waits on) over the lines they handed out is the figure; queueing the batches is timed apart.
The goal: flat within 1.5x from 100k to 10M lines.

    python bench/bench_queue.py [--sizes 100000 1000000 10000000] [--takes 3000]
    python bench/bench_queue.py --sizes 100000 300000 --takes 50 --baseline 319eb7e   # an older queue

`--baseline REV` runs the same load on `bulkgen/runtime/workqueue.py` as of git revision REV too.
The ratios are measured in one run; the load average before and after is printed with them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulkgen.runtime import workqueue  # noqa: E402
from bulkgen.runtime.lineindex import LineIndex  # noqa: E402

WORKERS = 8
WANT = 128


def build_index(lines: int, seed: int = 0) -> LineIndex:
    rng = np.random.default_rng(seed)
    starts = np.arange(lines, dtype=np.int64) * 200
    return LineIndex(
        np.arange(1, lines + 1, dtype=np.int64),
        starts,
        np.full(lines, 199, dtype=np.uint32),  # lengths
        rng.integers(10, 2000, lines).astype(np.int64),
        (np.arange(lines) // 2000 + 1).astype(np.uint64),
    )


def run(module: types.ModuleType, lines: int, takes: int, batch_lines: int) -> dict:
    q = module.WorkQueue(lambda _ranks: WORKERS)
    per = min(lines, batch_lines)
    t0 = time.process_time()
    for b in range(lines // per):
        index = build_index(per, seed=b)
        batch = module.QueuedBatch(
            f"batch_{b}", f"files/data/in{b}", "/v1/completions", "m", "p", float(b), {"url": "unused"}
        )
        batch.tenant = f"tenant{b % 2}"
        q.add_batch(batch, index, module.make_ranges(batch, index, np.ones(per, bool), 32))
    queued_s = time.process_time() - t0
    handed = 0
    inflight: list[list] = []
    t0 = time.process_time()
    for i in range(takes):
        taken = q.take(i % WORKERS, WANT, "m@p", idle=False)
        handed += sum(r.size for r in taken)
        inflight.append(taken)
        if len(inflight) > WORKERS:
            q.put_back(inflight.pop(0), count=False)
        q.pending_requests()
    cpu = time.process_time() - t0
    return {"lines": lines, "queue_s": queued_s, "cpu_s": cpu, "handed": handed, "takes": takes}


def baseline_module(rev: str) -> types.ModuleType:
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:bulkgen/runtime/workqueue.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    module = types.ModuleType(f"workqueue_{rev}")
    module.__dict__["__name__"] = module.__name__
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:workqueue.py", "exec"), module.__dict__)
    return module


def report(name: str, module: types.ModuleType, sizes: list[int], takes: int, batch_lines: int) -> None:
    print(
        f"{name}: batches of {batch_lines:,} lines; {takes} takes of {WANT} by {WORKERS} workers, each put back {WORKERS} takes later"
    )
    print(
        f"{'queued lines':>14} {'queue add s':>12} {'take CPU s':>11} {'us/line':>9} {'ms/take':>8} {'ratio':>6}"
    )
    first = None
    for lines in sizes:
        r = run(module, lines, takes, batch_lines)
        per_line = r["cpu_s"] / max(1, r["handed"]) * 1e6
        first = first or per_line
        print(
            f"{lines:>14,} {r['queue_s']:>12.2f} {r['cpu_s']:>11.3f} {per_line:>9.2f} "
            f"{r['cpu_s'] / takes * 1e3:>8.3f} {per_line / first:>6.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    parser.add_argument("--takes", type=int, default=3000)
    parser.add_argument("--batch-lines", type=int, default=50_000)
    parser.add_argument("--baseline", help="also run the queue of this git revision")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report("this queue", workqueue, args.sizes, args.takes, args.batch_lines)
    if args.baseline:
        module = baseline_module(args.baseline)
        report(f"queue at {args.baseline}", module, args.sizes, args.takes, args.batch_lines)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
