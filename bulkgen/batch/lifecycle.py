"""Every status change of a batch, and validation, the first of them.

The statuses and the moves between them are OpenAI's batch lifecycle as bulkgen runs it; `ALLOWED` is
the whole table, and `transition` refuses any move outside it (`IllegalTransition`: a bug, never a
client's error). Each door (the API's cancel, validation, the runner, finalize, the plan's refusal) calls
the named change here inside its conditional write (BatchRepo.update), so a status never moves from a
module of its own and `<status>_at` is stamped in one place.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.records import BatchRepo, FileRepo
from bulkgen.batch.schema import TERMINAL_STATUSES, BatchStatus, Conflict
from bulkgen.batch.validate import ValidationResult, Validator, validate_stream

S = BatchStatus
# A cancelled batch still validates (it then fails or is cancelled) and may end completed or expired when
# its runner had already decided so as the cancel landed; a finalizing one may still fail or expire.
ALLOWED: dict[BatchStatus, frozenset[BatchStatus]] = {
    S.VALIDATING: frozenset({S.IN_PROGRESS, S.FAILED, S.CANCELLING}),
    S.IN_PROGRESS: frozenset({S.FINALIZING, S.CANCELLING, S.FAILED, S.EXPIRED}),
    S.FINALIZING: frozenset({S.COMPLETED, S.FAILED, S.EXPIRED}),
    S.CANCELLING: frozenset({S.CANCELLED, S.FAILED, S.EXPIRED, S.COMPLETED}),
    **{status: frozenset() for status in TERMINAL_STATUSES},
}
# How a run that stopped early ends (its stop code) -> the final status; None: it ran to the end.
FINAL_STATUS = {None: S.COMPLETED, "batch_cancelled": S.CANCELLED, "batch_expired": S.EXPIRED}


class IllegalTransition(RuntimeError):
    """A status change outside ALLOWED: the caller's bug (the record is left as it was)."""


def transition(record: BatchRecord, status: BatchStatus, now: int | None = None) -> BatchRecord:
    """Move to `status` and stamp its `<status>_at` field once."""
    status = BatchStatus(status)
    if status not in ALLOWED[record.status]:
        raise IllegalTransition(f"batch {record.id}: {record.status} -> {status} is not a status change")
    record.status = status
    stamp = f"{status.value}_at"
    if getattr(record, stamp) is None:
        setattr(record, stamp, int(now if now is not None else time.time()))
    return record


def fail(record: BatchRecord, errors: dict) -> BatchRecord:
    """-> failed, with OpenAI's errors list saying why."""
    record.errors = errors
    return transition(record, S.FAILED)


def fail_unless_ended(record: BatchRecord, code: str, message: str) -> BatchRecord | None:
    """A batch its runner gave up on -> failed with one batch-wide error; an ended batch stays as it is."""
    if record.status in TERMINAL_STATUSES:
        return None
    entry = {"code": code, "line": None, "param": None, "message": message[:2000]}
    return fail(record, {"object": "list", "data": [entry]})


def cancel(record: BatchRecord) -> BatchRecord | None:
    """A client's cancel: -> cancelling (its runner ends it); None if already cancelled (idempotent)."""
    if record.status in (S.CANCELLING, S.CANCELLED):
        return None
    if record.status not in (S.VALIDATING, S.IN_PROGRESS):
        raise Conflict(
            f"batch {record.id} is {record.status} and can no longer be cancelled",
            code="batch_not_cancellable",
        )
    return transition(record, S.CANCELLING)


def begin_finalizing(record: BatchRecord) -> BatchRecord | None:
    """Every request has its result: in_progress -> finalizing (any other status: left as it is)."""
    if record.status != S.IN_PROGRESS:
        return None
    return transition(record, S.FINALIZING)


def close(record: BatchRecord, stop: str | None) -> BatchRecord:
    """The run's end -> completed, cancelled or expired (FINAL_STATUS); a cancel the runner stopped for
    that was never recorded (it stopped on its own) gets its `cancelling_at` too."""
    if stop == "batch_cancelled" and record.cancelling_at is None:
        transition(record, S.CANCELLING)
    return transition(record, FINAL_STATUS[stop])


def needs_validation(record: BatchRecord) -> bool:
    """`validating`, or cancelled before validation ended (no model recorded yet)."""
    return record.status == S.VALIDATING or (record.status == S.CANCELLING and record.model is None)


def validate_batch(
    files: FileRepo,
    batches: BatchRepo,
    batch_id: str,
    validator_for: Callable[[str], Validator],
    max_bytes: int,
    on_request: Callable | None = None,
    amend: Callable[[BatchRecord], BatchRecord] | None = None,
    checked: ValidationResult | None = None,
) -> BatchRecord:
    """validating -> in_progress, or -> failed with every error listed (code, line, param, message).

    The input streams through once in bounded memory, through `validator_for(endpoint)`; `on_request(line,
    offset, raw, request)` sees each line in that same pass (the runner's line index), a line refused for
    its body included: it runs as that line's 400, and `request_counts.total` counts it. A batch cancelled
    before or while it was validated is validated all the same but stays `cancelling`: its runner then
    writes every request as `batch_cancelled`, as for any cancelled batch. `amend(record)` adds to a batch
    that passed, in the same conditional write that makes it `in_progress` (the plan's estimate), so no
    reader sees it without. `checked`: the result of the pass that stored the file (a watcher's job
    defaults, `bulkgen run`): the file is not read again."""
    record = batches.get(batch_id)
    if not needs_validation(record):
        return record
    size = files.get(record.input_file_id)["bytes"]
    if size > max_bytes:
        errors = _error_list("file_too_large", f"the input file has {size} bytes; the limit is {max_bytes}")
        return batches.update(batch_id, lambda r: fail(r, errors) if needs_validation(r) else None)
    result = checked
    if result is None:
        with files.open(record.input_file_id) as reader:
            result = validate_stream(reader, validator_for(record.endpoint), on_request)

    def apply(r: BatchRecord) -> BatchRecord | None:
        if not needs_validation(r):
            return None
        if not result.ok:
            return fail(r, result.error_list())
        r.model = result.model
        r.request_counts.total = result.total
        if r.status != S.VALIDATING:
            return r
        r = transition(r, S.IN_PROGRESS)
        return amend(r) if amend is not None else r

    return batches.update(batch_id, apply)


def _error_list(code: str, message: str) -> dict:
    """A batch-level error about its input file, in OpenAI's errors list."""
    return {
        "object": "list",
        "data": [{"code": code, "line": None, "param": "input_file_id", "message": message}],
    }
