"""BatchStatus is the batch's status string, byte for byte, wherever a record goes: storage, the API, logs."""

from __future__ import annotations

import json

import pytest
from fastapi.encoders import jsonable_encoder
from openai.types import Batch

from bulkgen.batch.schema import (
    ACTIVE_STATUSES,
    TERMINAL_STATUSES,
    BatchStatus,
    new_batch_record,
    public_view,
    set_status,
)

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
    plain = json.loads(json.dumps(record))
    for name in ("in_progress", "finalizing", "cancelling", "cancelled"):
        set_status(record, BatchStatus(name), now=1_800_000_000)
        set_status(plain, name, now=1_800_000_000)
        assert type(record["status"]) is str  # what storage gives back, so stored and in-memory records agree
    assert json.dumps(record) == json.dumps(plain)
    assert record["cancelled_at"] == 1_800_000_000 and record["status"] == BatchStatus.CANCELLED
    # a member placed by hand still writes its value (the store's json, FastAPI's encoder, the SDK's model)
    by_hand = {**record, "status": BatchStatus.CANCELLED}
    assert json.dumps(by_hand) == json.dumps(plain)
    assert jsonable_encoder(public_view(by_hand)) == public_view(plain)
    sdk = Batch.model_validate(public_view(by_hand))
    assert sdk.to_json() == Batch.model_validate(public_view(plain)).to_json() and sdk.status == "cancelled"


def test_an_unknown_status_is_refused():
    with pytest.raises(ValueError, match="'canceled' is not a valid BatchStatus"):
        set_status(new_batch_record("file-abc", "/v1/completions", "24h", None), "canceled")
