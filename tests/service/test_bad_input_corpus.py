"""A corpus of bad input files (tests/service/bad_inputs/, expected errors in manifest.json), run through the
real API with the openai client: create answers `validating`, then the batch fails listing every error
(line, code, param) exactly; what the engine would refuse at run time is refused here, at create."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.service.conftest import chat_row, upload, validated, write_jsonl

CORPUS = Path(__file__).parent / "bad_inputs"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_bad_input_file_fails_with_every_error_named(client, name):
    expected = MANIFEST[name]
    batch = client.batches.create(input_file_id=upload(client, CORPUS / name).id, endpoint=expected["endpoint"],
                                  completion_window="24h")
    assert batch.status == "validating"
    batch = validated(client, batch.id)
    assert batch.status == "failed" and batch.failed_at is not None, expected["note"]
    got = sorted(([e.line, e.code, e.param] for e in batch.errors.data), key=lambda e: (e[0] or 0, e[1]))
    assert got == sorted(expected["errors"], key=lambda e: (e[0] or 0, e[1])), expected["note"]
    for error in batch.errors.data:
        assert error.message and len(error.message) < 300 and "\n" not in error.message


def test_engine_messages_name_the_body_field_and_the_value(client):
    batch = validated(client, client.batches.create(
        input_file_id=upload(client, CORPUS / "engine_rules.jsonl").id, endpoint="/v1/chat/completions",
        completion_window="24h").id)
    by_line = {e.line: e.message for e in batch.errors.data}
    assert by_line[2] == "body.top_p must be a number in (0, 1]; got 0"
    assert by_line[4].startswith("body.seed must be an int between 0 and 18446744073709551615; got 1180591620")
    assert "Overflow" not in json.dumps([e.message for e in batch.errors.data])


def test_errors_quote_input_briefly(client, tmp_path):
    """A 500 KB file id and 300 lines sharing a 10 KB custom_id: errors quote at most ~80 characters."""
    with pytest.raises(openai.BadRequestError) as info:
        client.batches.create(input_file_id="f" * 500_000, endpoint="/v1/chat/completions", completion_window="24h")
    assert info.value.response.status_code == 400 and len(info.value.response.content) < 400
    assert "500000 characters" in info.value.message
    long_id = "y" * 10_000
    rows = [chat_row(long_id, "hi") for _ in range(300)]
    batch = validated(client, client.batches.create(
        input_file_id=upload(client, write_jsonl(tmp_path / "long.jsonl", rows)).id,
        endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.status == "failed" and len(batch.errors.data) == 300
    assert {e.code for e in batch.errors.data} == {"invalid_custom_id"}
    assert len(json.dumps(batch.model_dump())) < 100_000   # 3 MB of custom_ids, not copied into the record
    with pytest.raises(openai.NotFoundError) as info:
        client.batches.retrieve("b" * 60_000)
    assert len(info.value.response.content) < 400


def test_create_refuses_unknown_fields_by_name(client, tmp_path):
    file_id = upload(client, write_jsonl(tmp_path / "ok.jsonl", [chat_row("a", "hi", max_tokens=1)])).id
    with pytest.raises(openai.BadRequestError) as info:
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                              extra_body={"priority": "high"})
    assert info.value.code == "unknown_parameter" and info.value.param == "priority"
    ok = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"k": "v"})
    assert ok.status == "validating" and ok.metadata == {"k": "v"}
    with pytest.raises(openai.BadRequestError, match="metadata"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"k": "v" * 513})


def test_a_batch_validated_under_looser_rules_refuses_only_those_lines(service, client, tmp_path):
    """A batch already `in_progress` from an older version (top_p 0 passed then): the line is refused alone,
    with the field named, and the batch completes."""
    from bulkgen.batch.schema import new_batch_record, set_status
    from tests.service.conftest import wait_done

    svc = service.svc
    rows = [chat_row("a", "hi", max_tokens=2), chat_row("old", "hi", max_tokens=2, top_p=0),
            chat_row("b", "hi", max_tokens=2)]
    file_id = upload(client, write_jsonl(tmp_path / "old.jsonl", rows)).id
    record = set_status(new_batch_record(file_id, "/v1/chat/completions", "24h", None), "in_progress")
    record.update(model="bulkgen-tiny", request_counts={"total": 3, "completed": 0, "failed": 0})
    svc.batches.create(record)
    svc.store.write_bytes("active/" + record["id"], b"")
    service.manager.wake()
    batch = wait_done(client, record["id"])
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    (error,) = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "old" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "body.top_p"
