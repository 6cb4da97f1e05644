"""The `bulkgen run` process's resident memory per line of a batch, phase by phase, without Ray or an engine
(issue 49): the driver's own share of a run, which tracemalloc cannot see when it is freed-but-kept heap.

For a file of `--lines` short chat lines on a local folder, in this process, after the same on 1,000 lines
(imports and caches are not per line): intake (store, validate and
index, as Driver.run does), the ranges queued (WorkQueue), every range taken and reported done to its
BatchRunner (a part written for it, 32 request metrics each: what a worker's poll brings), finalize, and
the result files. After each phase: the peak over it, what stays resident, and what would stay after a
forced malloc_trim: where the two differ, freed memory is kept by glibc's arenas, not held by the driver.

    python bench/bench_driver_memory.py [--lines 100000] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from bench_scale import write_file

    from bulkgen.batch.heap_trim import trim_heap
    from bulkgen.engine.process_memory import peak_rss, reset_peak_rss
    from bulkgen.models.registry import DEFAULT_MODEL_NAME

    n, rows = args.lines, []
    with tempfile.TemporaryDirectory(prefix="bulkgen-drivermem-") as tmp:
        warm, path = Path(tmp) / "warm.jsonl", Path(tmp) / "big.jsonl"
        write_file(warm, 1_000, DEFAULT_MODEL_NAME)
        write_file(path, n, DEFAULT_MODEL_NAME)
        _phases(Path(tmp) / "warm", warm, 1_000, lambda name: None)  # imports and caches: not per line
        gc.collect()
        trim_heap()
        start = last = reset_peak_rss()

        def phase(name: str) -> None:
            nonlocal last
            gc.collect()
            held = _rss()
            trim_heap()
            rows.append(
                {
                    "phase": name,
                    "peak_b_per_line": round((peak_rss() - last) / n),
                    "held_b_per_line": round((held - start) / n),
                    "held_after_trim_b_per_line": round((_rss() - start) / n),
                }
            )
            last = reset_peak_rss()

        _phases(Path(tmp) / "big", path, n, phase)
    load = round(os.getloadavg()[0], 2)
    if args.json:
        print(json.dumps({"lines": n, "phases": rows, "load_average": load}, indent=1))
    else:
        print(f"{n:,} lines; bytes a line: peak over the phase / resident after it / after a forced trim")
        for r in rows:
            print(
                f"  {r['phase']:24} {r['peak_b_per_line']:7} {r['held_b_per_line']:7} "
                f"{r['held_after_trim_b_per_line']:7}"
            )
        print(f"  load average after: {load}")
    return {"lines": n, "phases": rows}


def _phases(tmp: Path, path: Path, n: int, phase) -> None:
    from bulkgen.batch.outputlines import envelope
    from bulkgen.batch.records import FileRepo
    from bulkgen.batch.requests import custom_id_of
    from bulkgen.batch.resultfiles import local_results, write_results
    from bulkgen.batch.service import BatchService
    from bulkgen.runtime import parts
    from bulkgen.runtime.driver import Driver
    from bulkgen.runtime.finalize import finalize
    from bulkgen.runtime.lease import Lease
    from bulkgen.runtime.lineindex import read_lines
    from bulkgen.runtime.ranges import RangeOutcome
    from bulkgen.runtime.runner import BatchRunner
    from bulkgen.runtime.workqueue import QueuedBatch, WorkQueue, make_ranges
    from bulkgen.settings import Settings

    svc = BatchService(Settings(storage=str(tmp / "store"), max_requests_per_batch=max(50_000, n)))
    with path.open("rb") as f:
        record, index = Driver(svc)._intake(f, str(path), None, "24h")
    phase("intake")
    queue = WorkQueue(lambda ranks: 1, 10.0, dict)
    runner = BatchRunner(svc, queue, None, Lease(svc.store, record.id, "bench", 60), record.id, index)
    runner.done, runner.tally = parts.coverage(svc.store, record.id, index)
    batch = QueuedBatch(record.id, "", record.endpoint, record.model, "", 0.0, svc.store.open_args())
    queue.add_batch(batch, index, make_ranges(batch, index, ~runner.done, svc.settings.range_size))
    phase("ranges queued")
    key = FileRepo.data_key(record.input_file_id)
    answer = {
        "status_code": 200,
        "request_id": "req_bench",
        "body": {"choices": [{"message": {"content": "1"}}]},
    }
    metrics = dict.fromkeys(("arrival_time", "first_token_time", "finished_time", "num_prompt_tokens"), 1.0)
    while taken := queue.take(0, 64, batch.model_key, True):
        for r in taken:
            b = r.bounds
            lines = read_lines(svc.store, key, b.first_line, b.start, b.end)
            entries = [
                parts.PartEntry.of(i, True, envelope(custom_id_of(raw), answer, None)) for i, raw in lines
            ]
            parts.write_part(svc.store, record.id, b.first_line, b.last_line, entries)
            queue.settle(r, b.size)
            tally = parts.Tally(completed=b.size)
            runner.range_done(RangeOutcome(b, tally, [dict(metrics) for _ in range(b.size)]))
    queue.remove_batch(record.id)
    phase("ranges done")
    final = finalize(svc, record.id, None, runner.metrics)
    phase("finalize")
    folder, names = local_results(tmp / "out.jsonl")
    write_results(svc, final, folder, names, summarize=False)
    phase("result files")
    assert final.request_counts.completed == n, final.request_counts


if __name__ == "__main__":
    main(sys.argv[1:])
