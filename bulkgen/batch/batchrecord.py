"""The batch record: a typed `BatchRecord`, and the one place its stored JSON is read and written.

Storage holds the batch object as OpenAI's API returns it (every field, in the hosted API's order) plus
bulkgen's own fields and `x_bulkgen`, the bookkeeping clients never see. `from_json` and `to_json` are
the only code that knows those keys, so a record written by any version of this code reads back and
writes again byte for byte, and keys this version does not know are kept as they were read.
Status changes are not made here: bulkgen.batch.lifecycle owns every one of them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from bulkgen.batch.ids import new_id
from bulkgen.batch.schema import (
    INTERNAL,
    BatchStatus,
    batch_priority,
    check_endpoint,
    check_metadata,
    parse_completion_window,
)


def empty_usage() -> dict[str, Any]:
    """OpenAI's batch `usage` object before any request ran (written whole by bulkgen.runtime.parts.Tally)."""
    return {
        "input_tokens": 0,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 0,
    }


@dataclass
class RequestCounts:
    """The batch's `request_counts`: `total` set by validation, the others as results are written."""

    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass
class BatchRecord:
    """A batch as stored. Fields are declared in the order the JSON holds them (`object` is always
    "batch" and not kept); `internal` is `x_bulkgen`; `extra` holds keys this version does not know."""

    id: str
    endpoint: str
    errors: dict | None  # OpenAI's {"object": "list", "data": [{code, line, param, message}]}
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int = 0
    in_progress_at: int | None = None
    expires_at: int = 0
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    usage: dict[str, Any] = field(default_factory=empty_usage)
    model: str | None = None  # set by validation: the one model every line names
    metrics: dict[str, Any] | None = None  # bulkgen's throughput report and estimates
    retry_of: str | None = None  # bulkgen.batch.retry's links, both ways
    retried_by: str | None = None
    internal: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BatchRecord:
        """A record from its stored JSON object (as json.loads gives it)."""
        known, extra, values = _FIELD_NAMES, {}, {}
        for key, value in data.items():
            if key == "object":
                continue
            if key == INTERNAL:
                values["internal"] = value or {}
            elif key == "request_counts":
                values[key] = RequestCounts(**value)
            elif key == "status":
                values[key] = BatchStatus(value)
            elif key in known:
                values[key] = value
            else:
                extra[key] = value
        return cls(**values, extra=extra)

    def to_json(self) -> dict[str, Any]:
        """The stored JSON object: the hosted API's order, then bulkgen's fields, `x_bulkgen`, unknown keys."""
        out: dict[str, Any] = {}
        for name in _FIELD_NAMES:
            value = getattr(self, name)
            if name == "request_counts":
                value = asdict(value)
            elif name == "status":
                value = BatchStatus(value).value
            out[INTERNAL if name == "internal" else name] = value
            if name == "id":
                out["object"] = "batch"
        return {**out, **self.extra}

    def public(self) -> dict[str, Any]:
        """The batch object as clients see it (bulkgen's bookkeeping left out)."""
        view = self.to_json()
        del view[INTERNAL]
        return view

    def copy(self) -> BatchRecord:
        """A deep copy (what a conditional update changes, so the record read stays as read)."""
        return BatchRecord.from_json(_deep_copy(self.to_json()))


_FIELD_NAMES = tuple(f.name for f in fields(BatchRecord) if f.name != "extra")


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def new_batch_record(
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict | None,
    batch_id: str | None = None,
) -> BatchRecord:
    """A fresh batch in `validating`, with every field the hosted API returns, and bulkgen's own (`model`,
    `metrics`, the retry links `retry_of` and `retried_by`: bulkgen.batch.retry)."""
    window_s = parse_completion_window(completion_window)
    metadata = check_metadata(metadata)
    batch_priority(metadata)
    now = int(time.time())
    return BatchRecord(
        id=batch_id or new_id("batch_"),
        endpoint=check_endpoint(endpoint),
        errors=None,
        input_file_id=input_file_id,
        completion_window=completion_window,
        status=BatchStatus.VALIDATING,
        created_at=now,
        expires_at=now + window_s,
        metadata=metadata,
    )
