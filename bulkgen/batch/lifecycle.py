"""Status changes of validation, run by whoever holds the batch (the runtime's runner, `bulkgen run`)."""

from __future__ import annotations

from collections.abc import Callable

from bulkgen.batch.records import BatchRepo, FileRepo
from bulkgen.batch.schema import BatchStatus, set_status
from bulkgen.batch.validate import Validator, validate_stream


def validate_batch(
    files: FileRepo,
    batches: BatchRepo,
    batch_id: str,
    served_models,
    max_requests: int,
    max_bytes: int,
    on_request: Callable | None = None,
    amend: Callable[[dict], dict] | None = None,
    adapters: dict[str, str] | None = None,
) -> dict:
    """validating -> in_progress, or -> failed with every error listed (code, line, param, message).

    The input streams through once in bounded memory; `on_request(line, offset, raw, request)` sees each
    line in that same pass (the runner's line index), a line refused for its body included: it runs as that
    line's 400, and `request_counts.total` counts it. A batch cancelled before or while it was
    validated is validated all the same but stays `cancelling`: its runner then writes every request as
    `batch_cancelled`, as for any cancelled batch. `amend(record)` adds to a batch that passed, in the same
    conditional write that makes it `in_progress` (the plan's estimate), so no reader sees it without.
    `adapters`: the served LoRA adapters, name -> their base."""
    record = batches.get(batch_id)
    if not needs_validation(record):
        return record
    meta = files.get(record["input_file_id"])
    if meta["bytes"] > max_bytes:
        errors = {
            "object": "list",
            "data": [
                {
                    "code": "file_too_large",
                    "line": None,
                    "param": "input_file_id",
                    "message": f"the input file has {meta['bytes']} bytes; the limit is {max_bytes}",
                }
            ],
        }
        return batches.update(batch_id, lambda r: _fail(r, errors) if needs_validation(r) else None)
    validator = Validator(record["endpoint"], served_models, max_requests, adapters)
    with files.open(record["input_file_id"]) as reader:
        result = validate_stream(reader, validator, on_request)

    def apply(r: dict) -> dict | None:
        if not needs_validation(r):
            return None
        if not result.ok:
            return _fail(r, result.error_list())
        r["model"] = result.model
        r["request_counts"]["total"] = result.total
        if r["status"] != BatchStatus.VALIDATING:
            return r
        r = set_status(r, BatchStatus.IN_PROGRESS)
        return amend(r) if amend is not None else r

    return batches.update(batch_id, apply)


def needs_validation(record: dict) -> bool:
    """`validating`, or cancelled before validation ended (no model recorded yet)."""
    status = record["status"]
    return status == BatchStatus.VALIDATING or (status == BatchStatus.CANCELLING and record["model"] is None)


def _fail(record: dict, errors: dict) -> dict:
    record["errors"] = errors
    return set_status(record, BatchStatus.FAILED)
