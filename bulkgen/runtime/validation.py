"""Validation and indexing in one streamed pass: every door (the driver of `bulkgen run` and the watcher,
and a batch's runner when the API created it) validates and indexes a file this way."""

from __future__ import annotations

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.service import BatchService
from bulkgen.plan.admission import WorkTally, estimate_into
from bulkgen.runtime.lineindex import IndexBuilder, LineIndex


def validate_and_index(
    svc: BatchService, batch_id: str, queued_requests: int = 0
) -> tuple[BatchRecord, LineIndex | None]:
    """A batch in `validating` is checked, indexed and estimated in one streamed pass; -> (record, its line
    index). The index is None when this call did not validate the file (it was validated before, or by
    another process meanwhile) or the batch failed: whoever runs it then reads the file itself.
    `queued_requests`: the work ahead of the batch in the runtime's queue (the estimate's wait)."""
    builder, tally = IndexBuilder(), WorkTally()

    def index_and_tally(*line) -> None:
        builder.add(*line)
        tally.add(*line)

    record = svc.validate(
        batch_id,
        on_request=index_and_tally,
        amend=estimate_into(svc, tally, queued_requests, refuse=svc.settings.refuse_infeasible),
    )
    complete = record.model is not None and len(builder) == record.request_counts.total
    return record, (builder.build() if complete else None)
