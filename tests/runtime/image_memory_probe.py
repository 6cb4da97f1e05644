"""Run by tests/runtime/test_worker_image_memory.py in a fresh process, so its peak RSS is the worker's alone:
`python -m tests.runtime.image_memory_probe MODEL ROWS.json ROOT BUDGET_MIB` loads the tiny VLM in an
EngineWorker, runs the rows (chat lines with images) as one batch, and prints JSON: how far the process's
own peak RSS (bulkgen.engine.process_memory: reset before the batch) rose above its RSS then (`growth`), the
image budget's peak and what it held after, and each line's outcome (its error code and param, or "ok")."""

from __future__ import annotations

import dataclasses
import gc
import json
import sys

from bulkgen.engine.config import EngineConfig
from bulkgen.engine.process_memory import peak_rss, reset_peak_rss
from bulkgen.runtime.worker import EngineWorker
from bulkgen.settings import ImageSettings
from bulkgen.store import LocalStore
from tests.runtime.test_worker import _drain
from tests.runtime.test_worker_images import VLM, _stored
from tests.support.parts import stored_entries


def main(model: str, rows_path: str, root: str, budget_mib: int) -> dict:
    settings = {"image_memory_bytes": budget_mib << 20}
    known = {f.name for f in dataclasses.fields(ImageSettings)}  # runs against the code before the budget too
    worker = EngineWorker(
        0,
        EngineConfig(max_num_seqs=8),
        images=ImageSettings(**{k: v for k, v in settings.items() if k in known}),
    )
    worker.load(VLM, model)
    with open(rows_path) as f:
        rows = json.load(f)
    store = LocalStore(root)
    job, ranges = _stored(store, "batch_mem", rows)
    del rows
    gc.collect()
    before = reset_peak_rss()
    worker.assign(job, ranges)
    outcomes = _drain(worker, len(ranges), timeout=600)
    peak = peak_rss()
    lines = {}
    for entry in stored_entries(store, "batch_mem").values():
        error = None if entry["ok"] else entry["envelope"]["response"]["body"]["error"]
        lines[entry["line"]] = "ok" if error is None else [error["code"], error["param"], error["message"]]
    gc.collect()
    budget = getattr(worker, "image_budget", None)
    return {
        "growth": max(0, peak - before),
        "errors": [o.error for o in outcomes if o.error],
        "budget_peak": budget.peak if budget else None,
        "budget_used_after": budget.used if budget else None,
        "lines": lines,
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
