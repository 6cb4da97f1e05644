"""Retry of an ended batch: a new batch of only the input lines that did not succeed and may succeed now.

Which failures are worth a retry follows from the lines the runtime writes to error files:
  engine_error     500: the engine failed on the request, or the worker running it died again and again
                   (bulkgen.runtime.worker, BatchRunner.give_up; a worker that cannot read its range from
                   storage ends there too)
  batch_expired    never run: the completion window passed (bulkgen.batch.outputlines.not_run_line)
  batch_cancelled  never run: the batch was cancelled
  any other 5xx    a server-side fault, not the request's
and every input line with no result at all (a batch that failed while running, e.g. its storage or its
input could not be read: `batch_failed`). The rest are the request's own errors, all 400s
(context_length_exceeded, invalid_parameter, unsupported_parameter, invalid_messages, model_not_chat, ...):
the same body fails the same way again, so they are not retried.

Output and error files list their lines in input order, and a custom_id is unique in its file, so one
streamed pass over the input beside both files (bulkgen.batch.merged.ResultCursor) finds the lines to
retry in bounded memory.

The new batch keeps the original's endpoint, completion window, metadata and output_expires_after. Links
are fields of the records, not metadata (which stays the client's 16 pairs): the new batch's `retry_of`
names the original and the original's `retried_by` the new batch. A batch is retried at most once; its
retry is retried in turn, so the retries of one input form a chain (`bulkgen results --merged` follows it).

Concurrent retries of one batch: the winner is decided before anything is made. Each picks its new
batch's id, then claims the original with one conditional update that sets `retried_by` to it; the
others' updates find it set and answer 409 having made nothing. The winner then stores the input file
and creates the batch under that id (a failure there releases the claim). A claim whose batch never
appeared (its retry died in between) is taken over once CLAIM_GRACE_S has passed.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.ids import id_time, new_id
from bulkgen.batch.merged import ResultCursor, check_all_taken, requests
from bulkgen.batch.records import RecordNotFound
from bulkgen.batch.schema import ACTIVE_STATUSES, BatchStatus, Conflict, InvalidRequest

if TYPE_CHECKING:
    from bulkgen.batch.service import BatchService

CLAIM_GRACE_S = 600.0
RETRYABLE_CODES = frozenset({"engine_error", "batch_expired", "batch_cancelled"})
_SPOOL_BYTES = 8 * 2**20  # the new input file stays in memory up to this size, then spills to disk


def retryable(envelope: dict) -> bool:
    """An error-file line worth running again (the module docstring lists which and why)."""
    error = envelope.get("error") or {}
    response = envelope.get("response") or {}
    body_error = (response.get("body") or {}).get("error") or {}
    code = error.get("code") or body_error.get("code")
    return code in RETRYABLE_CODES or response.get("status_code", 0) >= 500


@dataclass
class Selection:
    """How the lines of an ended batch split: retried (written to the new input), succeeded, refused (4xx)."""

    retried: int = 0
    succeeded: int = 0
    refused: int = 0


def select_lines(
    input_lines: Iterable[bytes], outputs: Iterable[bytes], errors: Iterable[bytes], selection: Selection
) -> Iterator[bytes]:
    """The input lines to run again, in input order; `selection` counts how every line went."""
    done, failed = ResultCursor(outputs), ResultCursor(errors)
    for raw, custom_id in requests(input_lines):
        if done.take(custom_id) is not None:
            selection.succeeded += 1
            continue
        error = failed.take(custom_id)
        if error is not None and not retryable(json.loads(error)):
            selection.refused += 1
            continue
        selection.retried += 1
        yield raw
    check_all_taken((done, failed))


def retry_batch(svc: BatchService, batch_id: str) -> BatchRecord:
    """POST /v1/batches/{id}/retry: the new batch (validating), linked both ways with `batch_id`."""
    record = svc.batches.get(batch_id)  # another tenant's batch is not found here: 404
    _check_can_retry(svc, record)
    selection = Selection()
    with tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES) as spool:
        for raw in select_lines(*_result_streams(svc, record), selection):
            spool.write(raw + b"\n")
        if not selection.retried:
            raise InvalidRequest(
                f"batch {batch_id} has nothing to retry: {selection.succeeded} requests succeeded "
                f"and {selection.refused} failed with request errors (400s such as "
                "context_length_exceeded), which would fail the same way again",
                param="batch_id",
                code="nothing_to_retry",
            )
        retry_id = new_id("batch_")
        svc.batches.update(batch_id, lambda r: _claim(svc, r, retry_id))  # Conflict: another retry won
        try:
            spool.seek(0)
            return _create(svc, record, retry_id, spool)
        except BaseException:
            with contextlib.suppress(Exception):  # else the claim lapses after CLAIM_GRACE_S
                svc.batches.update(batch_id, lambda r: _release(r, retry_id))
            raise


def _create(svc: BatchService, record: BatchRecord, retry_id: str, lines: BinaryIO) -> BatchRecord:
    """The retry batch `retry_id` of the lines in `lines`, as the original (its input file goes again if
    the batch cannot be made)."""
    new_file = svc.files.create(lines, f"{record.id}_retry.jsonl", "batch")
    try:
        return svc.create_batch(
            new_file["id"],
            record.endpoint,
            record.completion_window,
            record.metadata,
            output_expires_after_s=record.internal.get("output_expires_after_s"),
            retry_of=record.id,
            batch_id=retry_id,
        )
    except BaseException:
        with contextlib.suppress(Exception):  # else `bulkgen gc` never knows it: best effort
            svc.files.delete(new_file["id"])
        raise


def _check_can_retry(svc: BatchService, record: BatchRecord) -> None:
    batch_id, status = record.id, record.status
    if status in ACTIVE_STATUSES:
        raise Conflict(
            f"batch {batch_id} is {status}; retry it once it has ended (cancel it to end it now)",
            param="batch_id",
            code="batch_not_ended",
        )
    _check_not_retried(svc, record)
    if status == BatchStatus.FAILED and record.model is None:
        raise InvalidRequest(
            f"batch {batch_id} failed validation, so none of its requests ran and a retry "
            "would fail the same way; fix the input file (the batch's errors name each line) "
            "and create a new batch",
            param="batch_id",
            code="nothing_to_retry",
        )


def _check_not_retried(svc: BatchService, record: BatchRecord) -> None:
    retried_by = record.retried_by
    if retried_by and not _abandoned(svc, retried_by):
        raise Conflict(
            f"batch {record.id} was already retried by {retried_by}; retry that batch to go on",
            param="batch_id",
            code="already_retried",
        )


def _abandoned(svc: BatchService, retry_id: str) -> bool:
    """A claim whose batch does not exist CLAIM_GRACE_S after its id was made: its retry died midway."""
    try:
        svc.batches.get(retry_id)
    except RecordNotFound:
        return time.time() - (id_time(retry_id) or 0.0) > CLAIM_GRACE_S
    return False


def _claim(svc: BatchService, record: BatchRecord, retry_id: str) -> BatchRecord:
    _check_not_retried(svc, record)
    record.retried_by = retry_id
    return record


def _release(record: BatchRecord, retry_id: str) -> BatchRecord | None:
    if record.retried_by != retry_id:  # not ours (any more): leave it
        return None
    record.retried_by = None
    return record


def _result_streams(svc: BatchService, record: BatchRecord) -> tuple[Iterator[bytes], ...]:
    """The input, output and error lines of an ended batch; a file gone means its lines cannot be told
    apart, so the retry is refused rather than guessed."""
    streams = []
    for field, file_id in (
        ("input_file_id", record.input_file_id),
        ("output_file_id", record.output_file_id),
        ("error_file_id", record.error_file_id),
    ):
        if file_id is None:
            streams.append(iter(()))
            continue
        try:
            svc.files.get(file_id)
        except RecordNotFound:
            what = field.removesuffix("_file_id")
            raise InvalidRequest(
                f"the {what} file {file_id} of batch {record.id} has expired or was deleted, so "
                "which of its requests need a retry is unknown",
                param="batch_id",
                code="file_gone",
            ) from None
        streams.append(svc.files.iter_lines(file_id))
    return tuple(streams)
