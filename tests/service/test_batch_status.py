"""BatchStatus is the batch's status string, byte for byte, wherever a record goes: storage, the API, logs."""

from __future__ import annotations

import json

import pytest
from fastapi.encoders import jsonable_encoder
from openai.types import Batch

from bulkgen.batch.batchrecord import new_batch_record
from bulkgen.batch.lifecycle import transition
from bulkgen.batch.schema import ACTIVE_STATUSES, TERMINAL_STATUSES, BatchStatus

# The statuses of OpenAI's batch object, in the order /metrics lists them.
NAMES = [
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
]


def test_members_are_the_api_strings():
    assert [s.value for s in BatchStatus] == NAMES
    assert ACTIVE_STATUSES | TERMINAL_STATUSES == set(NAMES) and not ACTIVE_STATUSES & TERMINAL_STATUSES
    for name in NAMES:  # a record read back from storage holds plain strings: they must find the members
        member = BatchStatus(name)
        assert member == name and hash(member) == hash(name) and {name: 1}[member] == 1
        assert (name in TERMINAL_STATUSES) != (name in ACTIVE_STATUSES)
        assert str(member) == f"{member}" == name and f"{member:>12}_at" == f"{name:>12}_at"


def test_a_record_serializes_as_with_plain_strings():
    record = new_batch_record("file-abc", "/v1/chat/completions", "24h", {"k": "v"})
    for name in ("in_progress", "cancelling", "cancelled"):
        transition(record, BatchStatus(name), now=1_800_000_000)
    stored = record.to_json()
    assert type(stored["status"]) is str  # what storage gives back, so stored and in-memory records agree
    assert stored["cancelled_at"] == 1_800_000_000 and record.status == BatchStatus.CANCELLED
    assert json.loads(json.dumps(stored)) == stored
    # the public view goes through FastAPI's encoder and the SDK's model unchanged
    assert jsonable_encoder(record.public()) == record.public() and "x_bulkgen" not in record.public()
    sdk = Batch.model_validate(record.public())
    assert sdk.status == "cancelled" and sdk.cancelled_at == 1_800_000_000


def test_an_unknown_status_is_refused():
    with pytest.raises(ValueError, match="'canceled' is not a valid BatchStatus"):
        transition(new_batch_record("file-abc", "/v1/completions", "24h", None), "canceled")
