"""A corpus of bad input files (tests/service/bad_inputs/, expected outcomes in manifest.json), run through the
real API with the openai client. A file with something wrong with the FILE fails listing every error (line,
code, param) exactly; one whose only problems are request BODIES completes, each refused line getting its
400 in the error file with `param` naming the field, and every other line running."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.support.service import chat_row, read_lines, upload, validated, wait_done, write_jsonl

CORPUS = Path(__file__).parent / "bad_inputs"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())


def _run(client, name: str, endpoint: str):
    batch = client.batches.create(
        input_file_id=upload(client, CORPUS / name).id, endpoint=endpoint, completion_window="24h"
    )
    assert batch.status == "validating"
    return wait_done(client, batch.id)


def refused(client, batch) -> list[list]:
    """[custom_id, code, param] of each 400 line in the batch's error file."""
    return sorted(
        [e["custom_id"], e["response"]["body"]["error"]["code"], e["response"]["body"]["error"]["param"]]
        for e in read_lines(client, batch.error_file_id)
        if e["response"]["status_code"] == 400
    )


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_bad_input_file_fails_or_refuses_each_line_by_name(client, name):
    expected = MANIFEST[name]
    batch = _run(client, name, expected["endpoint"])
    assert batch.status == expected["status"], (expected["note"], batch.errors)
    if expected["status"] == "failed":
        assert batch.failed_at is not None
        got = sorted(([e.line, e.code, e.param] for e in batch.errors.data), key=lambda e: (e[0] or 0, e[1]))
        assert got == sorted(expected["errors"], key=lambda e: (e[0] or 0, e[1])), expected["note"]
        for error in batch.errors.data:
            assert error.message and len(error.message) < 300 and "\n" not in error.message
        return
    lines = [raw for raw in (CORPUS / name).read_text().splitlines() if raw.strip()]
    assert refused(client, batch) == sorted(expected["refused"]), expected["note"]
    counts = batch.request_counts
    assert (counts.total, counts.failed) == (len(lines), len(expected["refused"]))
    assert counts.completed == len(read_lines(client, batch.output_file_id)) == len(lines) - counts.failed


def test_engine_messages_name_the_body_field_and_the_value(client):
    batch = _run(client, "engine_rules.jsonl", "/v1/chat/completions")
    by_id = {
        e["custom_id"]: e["response"]["body"]["error"]["message"]
        for e in read_lines(client, batch.error_file_id)
    }
    assert by_id["seed-huge"] == (
        "body.seed must be an integer between -9223372036854775808 and "
        "9223372036854775807; got 1180591620717411303424"
    )
    assert by_id["top-p-bool"] == "body.top_p must be a number between 0 and 1; got True"
    assert "Overflow" not in json.dumps(by_id)


def test_errors_quote_input_briefly(client, tmp_path):
    """A 500 KB file id and 300 lines sharing a 10 KB custom_id: errors quote at most ~80 characters."""
    with pytest.raises(openai.BadRequestError) as info:
        client.batches.create(
            input_file_id="f" * 500_000, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert info.value.response.status_code == 400 and len(info.value.response.content) < 400
    assert "500000 characters" in info.value.message
    long_id = "y" * 10_000
    rows = [chat_row(long_id, "hi") for _ in range(300)]
    batch = validated(
        client,
        client.batches.create(
            input_file_id=upload(client, write_jsonl(tmp_path / "long.jsonl", rows)).id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        ).id,
    )
    assert batch.status == "failed" and len(batch.errors.data) == 300
    assert {e.code for e in batch.errors.data} == {"invalid_custom_id"}
    assert len(json.dumps(batch.model_dump())) < 100_000  # 3 MB of custom_ids, not copied into the record
    with pytest.raises(openai.NotFoundError) as info:
        client.batches.retrieve("b" * 60_000)
    assert len(info.value.response.content) < 400


def test_create_refuses_unknown_fields_by_name(client, tmp_path):
    file_id = upload(client, write_jsonl(tmp_path / "ok.jsonl", [chat_row("a", "hi", max_tokens=1)])).id
    with pytest.raises(openai.BadRequestError) as info:
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"priority": "high"},
        )
    assert info.value.code == "unknown_parameter" and info.value.param == "priority"
    ok = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": "v"}
    )
    assert ok.status == "validating" and ok.metadata == {"k": "v"}
    with pytest.raises(openai.BadRequestError, match="metadata"):
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"k": "v" * 513},
        )


def test_a_batch_validated_under_looser_rules_refuses_only_those_lines(service, client, tmp_path):
    """Workers parse every line themselves rather than trust validation: in a batch `in_progress` whose lines
    were never validated, a line the parser refuses (top_p 1.5) is refused alone by its worker, with the field
    named, and the batch completes."""
    from bulkgen.batch import lifecycle
    from bulkgen.batch.batchrecord import RequestCounts, new_batch_record

    svc = service.svc
    rows = [
        chat_row("a", "hi", max_tokens=2),
        chat_row("old", "hi", max_tokens=2, top_p=1.5),
        chat_row("b", "hi", max_tokens=2),
    ]
    file_id = upload(client, write_jsonl(tmp_path / "old.jsonl", rows)).id
    record = lifecycle.transition(
        new_batch_record(file_id, "/v1/chat/completions", "24h", None), "in_progress"
    )
    record.model, record.request_counts = "bulkgen-tiny", RequestCounts(total=3)
    svc.batches.create(record)
    svc.store.write_bytes("active/" + record.id, b"")
    service.manager.wake()
    batch = wait_done(client, record.id)
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (
        2,
        1,
    )
    (error,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "old" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "body.top_p"
