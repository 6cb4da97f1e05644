"""Nothing accepted is lost: a restarted service resumes active batches from the parts already written."""

from __future__ import annotations

import json

from bulkgen.config import Context
from bulkgen.oneshot import accept
from bulkgen.runtime import parts
from bulkgen.runtime.manager import run_batch
from bulkgen.runtime.pool import WorkerPool
from tests.service.conftest import Service, chat_row, read_lines, settings_for, wait_done, write_jsonl


def _accepted_batch(ctx: Context, path) -> str:
    """A batch as the API leaves it after create: validated, in_progress, nobody running it yet."""
    with path.open("rb") as f:
        record = accept(ctx, f, path.name, "/v1/chat/completions", "24h")
    assert record["status"] == "in_progress"
    return record["id"]


def test_service_start_resumes_accepted_batches(tmp_path):
    settings = settings_for(str(tmp_path / "store"))
    batch_id = _accepted_batch(Context(settings), write_jsonl(tmp_path / "a.jsonl",
                                                              [chat_row(f"r{i}", f"q{i}") for i in range(5)]))
    service = Service(settings)  # a new process would do exactly this on start
    try:
        client = service.client()
        batch = wait_done(client, batch_id)
        assert batch.status == "completed" and len(read_lines(client, batch.output_file_id)) == 5
    finally:
        service.stop()


def test_runner_skips_written_parts_and_writes_each_custom_id_once(tmp_path):
    settings = settings_for(str(tmp_path / "store"))  # chunk_size 16
    ctx = Context(settings)
    rows = [chat_row(f"r{i}", "x" * (i % 7), max_tokens=1 + i % 5) for i in range(40)]
    batch_id = _accepted_batch(ctx, write_jsonl(tmp_path / "b.jsonl", rows))
    pool = WorkerPool(settings.pool)
    pool.start()
    first = run_batch(ctx, pool, batch_id)
    assert first["status"] == "completed"
    kept = ctx.store.read_bytes(parts.part_key(batch_id, 0))

    # a crash after chunk 0: later parts and the final files never got written
    ctx.store.delete(parts.part_key(batch_id, 1))
    ctx.store.delete(parts.part_key(batch_id, 2))

    def back_to_work(record: dict) -> dict:
        record.update(status="in_progress", output_file_id=None, error_file_id=None, finalizing_at=None,
                      completed_at=None)
        return record

    ctx.batches.update(batch_id, back_to_work)
    second = run_batch(ctx, pool, batch_id)
    assert second["status"] == "completed"
    assert ctx.store.read_bytes(parts.part_key(batch_id, 0)) == kept  # not re-run, not rewritten
    assert ctx.store.exists(parts.part_key(batch_id, 1)) and ctx.store.exists(parts.part_key(batch_id, 2))
    with ctx.files.open(second["output_file_id"]) as f:
        custom_ids = [json.loads(line)["custom_id"] for line in f.read().decode().splitlines()]
    assert custom_ids == [r["custom_id"] for r in rows]
    assert second["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
