"""Status changes shared by the API (which validates at once) and the runner (which resumes)."""

from __future__ import annotations

from bulkgen.batch.records import BatchRepo, FileRepo
from bulkgen.batch.schema import set_status
from bulkgen.batch.validate import validate_lines


def validate_batch(
    files: FileRepo, batches: BatchRepo, batch_id: str, served_models, max_requests: int, max_bytes: int
) -> dict:
    """validating -> in_progress, or -> failed with every error listed (code, line, param, message)."""
    record = batches.get(batch_id)
    if record["status"] != "validating":
        return record
    meta = files.get(record["input_file_id"])
    if meta["bytes"] > max_bytes:
        errors = {"object": "list", "data": [{
            "code": "file_too_large", "line": None, "param": "input_file_id",
            "message": f"the input file has {meta['bytes']} bytes; the limit is {max_bytes}"}]}
        return batches.update(batch_id, lambda r: _fail(r, errors))
    result = validate_lines(files.iter_lines(record["input_file_id"]), record["endpoint"], served_models, max_requests)

    def apply(r: dict) -> dict | None:
        if r["status"] != "validating":  # cancelled meanwhile: leave it to the runner
            return None
        if not result.ok:
            return _fail(r, result.error_list())
        r["model"] = result.model
        r["request_counts"]["total"] = result.total
        return set_status(r, "in_progress")

    return batches.update(batch_id, apply)


def _fail(record: dict, errors: dict) -> dict:
    record["errors"] = errors
    return set_status(record, "failed")
