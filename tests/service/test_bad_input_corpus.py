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
