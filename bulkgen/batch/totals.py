"""Running totals of ended batches, so /metrics costs the same with 10 or 10,000 stored batches.

`layout.TOTALS` holds the sums over every ended batch: batches by final status, request counts,
tokens, worker busy time, and each LoRA adapter's requests and tokens. A batch is added once, when it ends (`BatchService.mark_ended`), by a
conditional read-modify-write; the last ids added are kept in it, so an ending that is retried (its
runner died after adding, before clearing the active index) is not added twice. Live batches are
read from the active index instead, so they are never in the totals.
"""

from __future__ import annotations

import json

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.schema import TERMINAL_STATUSES
from bulkgen.store import NotFound, Store, layout
from bulkgen.store.conditional import update_json

TOTALS_KEY = layout.TOTALS
RECENT_IDS = 1000


def empty() -> dict:
    return {
        "batches": {s.value: 0 for s in sorted(TERMINAL_STATUSES)},
        "requests": {"completed": 0, "failed": 0},
        "tokens": {"input": 0, "output": 0, "cached": 0},
        "worker_busy_s": {},
        "adapters": {},  # LoRA adapter -> its requests and tokens
        "recent": [],
    }


def load(store: Store) -> dict:
    try:
        return json.loads(store.read_bytes(TOTALS_KEY))
    except NotFound:
        return empty()


def add(totals: dict, record: BatchRecord) -> None:
    """Add one batch's counts (ended or not: /metrics adds live ones to a copy)."""
    counts, usage = record.request_counts, record.usage
    totals["batches"][record.status] = totals["batches"].get(record.status, 0) + 1
    totals["requests"]["completed"] += counts.completed
    totals["requests"]["failed"] += counts.failed
    totals["tokens"]["input"] += usage["input_tokens"]
    totals["tokens"]["output"] += usage["output_tokens"]
    totals["tokens"]["cached"] += usage["input_tokens_details"]["cached_tokens"]
    for worker, stats in ((record.metrics or {}).get("per_worker") or {}).items():
        busy = totals["worker_busy_s"]
        busy[worker] = busy.get(worker, 0.0) + (stats.get("busy_time_s") or 0)
    for name, counts in ((record.metrics or {}).get("adapters") or {}).items():
        mine = totals.setdefault("adapters", {}).setdefault(name, dict.fromkeys(counts, 0))
        for key, value in counts.items():
            mine[key] = mine.get(key, 0) + value


def add_ended(store: Store, record: BatchRecord, attempts: int = 50) -> bool:
    """Add an ended batch once; False if it was already in."""
    if record.status not in TERMINAL_STATUSES:
        raise ValueError(f"batch {record.id} is {record.status}, not ended")

    def added(totals: dict) -> dict | None:
        if record.id in totals["recent"]:
            return None
        add(totals, record)
        totals["recent"] = (totals["recent"] + [record.id])[-RECENT_IDS:]
        return totals

    return update_json(store, TOTALS_KEY, added, missing=empty(), attempts=attempts)[1] is not None
