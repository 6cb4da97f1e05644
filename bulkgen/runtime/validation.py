"""Validation and indexing in one streamed pass: every door (the driver of `bulkgen run` and the watcher,
and a batch's runner when the API created it) validates and indexes a file this way.

A door that stores the file itself (the driver) validates it in the pass that stores it (`check_into`):
the first line's url gives the endpoint and a watcher job's defaults are set in each line as it is parsed,
so each line is parsed once, and the batch's validation then takes that pass's result (`Checked`).

What the pass needed only while it ran (the custom_id table: ~110 bytes a request) is handed back to the
system when the batch's validation ends (`trim_heap`): freed, it stayed in the C heap's arenas, under
whatever the process allocated next, so a `bulkgen run` of 100k lines held ~150 bytes a request after
validation instead of the index's and tally's 40 (issue 49).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import BinaryIO

from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.heap_trim import trim_heap
from bulkgen.batch.requests import Fill
from bulkgen.batch.service import BatchService
from bulkgen.batch.validate import ValidationResult, validate_stream
from bulkgen.plan.admission import WorkTally, estimate_into
from bulkgen.runtime.lineindex import IndexBuilder, LineIndex


@dataclass
class Checked:
    """A file validated, indexed and tallied in the pass that stored it: its batch's validation takes
    this instead of reading the file again."""

    endpoint: str  # the batch's endpoint: the one given, or the first request line's url
    result: ValidationResult
    builder: IndexBuilder = field(default_factory=IndexBuilder)
    tally: WorkTally = field(default_factory=WorkTally)

    def add(self, *line) -> None:
        self.builder.add(*line)
        self.tally.add(*line)


def check_into(
    svc: BatchService,
    reader: BinaryIO,
    sink: BinaryIO,
    endpoint: str | None,
    fill: Fill | None = None,
    found: bool = False,
) -> Checked:
    """Copy `reader` into `sink` (the file to store), each line with `fill`'s defaults written in, and
    validate, index and tally it in the same pass. `endpoint` None: the first request line's url
    (InvalidRequest where it is no batch endpoint). NotABatchFile: the file is none (see `found`:
    bulkgen.batch.validate.Validator)."""
    validator = svc.validator(endpoint, fill, found)
    checked = Checked("", validator.result)
    validate_stream(reader, validator, checked.add, sink)
    checked.endpoint = validator.endpoint
    return checked


def validate_and_index(
    svc: BatchService, batch_id: str, queued_requests: int = 0, checked: Checked | None = None
) -> tuple[BatchRecord, LineIndex | None]:
    """A batch in `validating` is checked, indexed and estimated in one streamed pass (or by `checked`,
    the pass that stored its file); -> (record, its line index). The index is None when this call did not
    validate the file (it was validated before, or by another process meanwhile) or the batch failed:
    whoever runs it then reads the file itself. `queued_requests`: the work ahead of the batch in the
    runtime's queue (the estimate's wait)."""
    seen = checked or Checked("", ValidationResult())
    record = svc.validate(
        batch_id,
        on_request=seen.add,
        amend=estimate_into(svc, seen.tally, queued_requests, refuse=svc.settings.refuse_infeasible),
        checked=checked.result if checked is not None else None,
    )
    complete = record.model is not None and len(seen.builder) == record.request_counts.total
    trim_heap()  # the pass's custom_id table is gone: its pages back to the system (module docstring)
    return record, (seen.builder.build() if complete else None)
