"""BatchService's on_batch_end hook: once per batch end, by the one writer that ended it, for every tenant,
and a hook that fails never undoes the ending. No engine needed: these batches end without running."""

from __future__ import annotations

import io
import json
import threading

from bulkgen.batch import lifecycle
from bulkgen.batch.service import BatchService
from bulkgen.settings import Settings


def _service(tmp_path, ended: list) -> BatchService:
    settings = Settings(storage=str(tmp_path / "storage"), models={"served": str(tmp_path / "unused-model")})
    return BatchService(settings, on_batch_end=ended.append)


def _batch(svc: BatchService, model: str) -> dict:
    row = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": model, "prompt": "hi", "max_tokens": 2},
    }
    file = svc.files.create(io.BytesIO(json.dumps(row).encode() + b"\n"), "in.jsonl", "batch")
    return svc.create_batch(file["id"], "/v1/completions", "24h", None)


def test_a_batch_failed_at_validation_ends_once_for_any_tenant(tmp_path):
    ended: list[dict] = []
    svc = _service(tmp_path, ended)
    made = [
        (svc, _batch(svc, "not-served")),
        (svc.for_tenant("acme"), _batch(svc.for_tenant("acme"), "not-served")),
        (svc, _batch(svc, "served")),
    ]
    assert {b.status for _, b in made} == {"validating"} and ended == []
    failed, other, running = (owner.validate(b.id) for owner, b in made)  # what a runner does first
    assert (failed.status, other.status, running.status) == ("failed", "failed", "in_progress")
    assert [r.id for r in ended] == [failed.id, other.id]
    assert ended[0] == svc.batches.get(failed.id)  # the final record, as stored
    assert svc.validate(failed.id).status == "failed" and len(ended) == 2  # looking again ends nothing


def test_replicas_racing_to_end_a_batch_call_the_hook_once(tmp_path):
    ended: list[dict] = []
    svc = _service(tmp_path, ended)
    batch_id = svc.validate(_batch(svc, "served").id).id  # in_progress: a run that may stop either way
    replicas = [BatchService(svc.settings, on_batch_end=ended.append) for _ in range(6)]  # one storage
    start = threading.Barrier(len(replicas))

    def end(replica: BatchService, status: str) -> None:
        start.wait()
        replica.batches.update(
            batch_id,
            lambda r: None if r.status in ("cancelled", "expired") else lifecycle.close(r, f"batch_{status}"),
        )

    threads = [
        threading.Thread(target=end, args=(r, ("cancelled", "expired")[i % 2]))
        for i, r in enumerate(replicas)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (record,) = ended
    assert record == svc.batches.get(batch_id) and record.status in ("cancelled", "expired")


def test_a_failing_hook_does_not_undo_the_ending(tmp_path, caplog):
    def broken(record: dict) -> None:
        raise RuntimeError("receiver queue exploded")

    svc = BatchService(Settings(storage=str(tmp_path / "s"), models={"served": "x"}), on_batch_end=broken)
    failed = svc.validate(_batch(svc, "not-served").id)
    assert failed.status == "failed" and svc.batches.get(failed.id).status == "failed"
    assert "on_end hook failed" in caplog.text
