"""Bad input: the batch fails validation with every error listed; the server never answers 500."""

from __future__ import annotations

import json
from urllib.request import Request, urlopen

import openai
import pytest

from tests.support.service import SAMPLES, chat_row, upload, validated, write_jsonl


def _create(client, path, endpoint="/v1/chat/completions"):
    """Create answers `validating` at once (as the hosted API does); the runtime then validates."""
    batch = client.batches.create(
        input_file_id=upload(client, path).id, endpoint=endpoint, completion_window="24h"
    )
    assert batch.status == "validating"
    return validated(client, batch.id)


def test_invalid_sample_lists_every_error_with_its_line(client):
    batch = _create(client, SAMPLES / "invalid.jsonl")
    assert batch.status == "failed" and batch.failed_at is not None
    found = sorted((e.line, e.code) for e in batch.errors.data)
    assert found == [
        (2, "duplicate_custom_id"),
        (3, "invalid_json_line"),
        (4, "missing_custom_id"),
        (5, "url_mismatch"),
        (6, "model_mismatch"),
    ]
    by_code = {e.code: e for e in batch.errors.data}
    assert by_code["url_mismatch"].param == "url"
    assert (
        "line 1" in by_code["duplicate_custom_id"].message and by_code["duplicate_custom_id"].line == 2
    )  # names where the id was first used
    assert client.batches.retrieve(batch.id).status == "failed"


@pytest.mark.parametrize(
    ("content", "code"),
    [
        (b"", "empty_file"),
        (b"\n\n", "empty_file"),
        (b"\x89PNG\r\n\x1a\n\x00\x00binary", "invalid_json_line"),
        (b"[1, 2, 3]\n", "invalid_json_line"),
    ],
)
def test_not_jsonl_or_empty(client, tmp_path, content, code):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    batch = _create(client, path)
    assert batch.status == "failed"
    assert batch.errors.data[0].code == code


def test_unknown_model_and_bad_fields_name_line_and_param(client, tmp_path):
    rows = [
        chat_row("a", "hi", model="no-such-model") | {},
        {**chat_row("b", "hi"), "method": "GET"},
        chat_row("c", "hi", stream=True),
        chat_row("d", "hi", temperature=9),
        chat_row("e", "hi", n=0),
    ]
    for (
        row
    ) in rows:  # one model per file, not served: the first line names it; the body errors are listed too
        row["body"]["model"] = "no-such-model"
    batch = _create(client, write_jsonl(tmp_path / "m.jsonl", rows))
    errors = {(e.line, e.code, e.param) for e in batch.errors.data}
    assert (1, "model_not_found", "body.model") in errors
    assert (2, "invalid_method", "method") in errors
    assert (3, "invalid_request", "body.stream") in errors
    assert (4, "invalid_parameter", "body.temperature") in errors
    assert (5, "invalid_parameter", "body.n") in errors  # body errors are listed too when the file fails


def test_too_many_tasks(client, tmp_path):
    rows = [chat_row(f"r{i}", "hi") for i in range(501)]  # the test service allows 500
    batch = _create(client, write_jsonl(tmp_path / "big.jsonl", rows))
    assert [e.code for e in batch.errors.data] == ["too_many_tasks"]


def test_api_errors_are_4xx_with_openai_shape(service, client, tmp_path):
    file_id = upload(client, write_jsonl(tmp_path / "ok.jsonl", [chat_row("a", "hi", max_tokens=1)])).id
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="2d")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=file_id, endpoint="/v1/moderations", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="metadata"):
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={f"k{i}": "v" for i in range(17)},
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_doesnotexist")
    with pytest.raises(openai.NotFoundError):
        client.files.content("../../etc/passwd")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    request = Request(
        f"{service.base_url}/batches",
        data=b"{not json",
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": "Bearer k"},
    )
    with pytest.raises(Exception) as info:
        urlopen(request)
    assert info.value.code == 400 and "error" in json.loads(info.value.read())
    ok = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="72h"
    )
    assert ok.expires_at - ok.created_at == 72 * 3600  # any whole number of hours


@pytest.mark.parametrize("window", ["٢٤h", "24 h", " 24h ", "24h\n", "24H", "+24h"])
def test_completion_window_is_ascii_digits_and_h(client, tmp_path, window):
    file_id = upload(client, write_jsonl(tmp_path / "ok.jsonl", [chat_row("a", "hi", max_tokens=1)])).id
    with pytest.raises(openai.BadRequestError) as info:
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window=window
        )
    assert info.value.body["param"] == "completion_window"


@pytest.mark.parametrize(
    ("expires_after", "param"),
    [
        ({"anchor": "", "seconds": 3600}, "expires_after[anchor]"),
        ({"anchor": "created_at"}, "expires_after[seconds]"),
        ({"anchor": "created_at", "seconds": "٣٦٠٠"}, "expires_after[seconds]"),
        ({"anchor": "created_at", "seconds": " 3600"}, "expires_after[seconds]"),
    ],
)
def test_expires_after_parts_are_both_given_and_exact(client, expires_after, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch", expires_after=expires_after)
    assert info.value.body["param"] == param


@pytest.mark.parametrize("after", ["not an id", "../x", "file-1\n", "é"])
def test_a_malformed_after_cursor_is_a_400_naming_it(client, after):
    for listing in (client.files.list, client.batches.list):
        with pytest.raises(openai.BadRequestError) as info:
            listing(after=after)
        assert (info.value.body["param"], info.value.body["code"]) == ("after", "invalid_cursor")
    assert client.files.list(after="file-" + "f" * 24).data == []  # well formed: a position, even if unknown


def test_cancel_a_finished_batch_is_a_conflict(client, tmp_path):
    from tests.support.service import wait_done

    file_id = upload(client, write_jsonl(tmp_path / "c.jsonl", [chat_row("a", "hi", max_tokens=1)])).id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_done(client, batch.id)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_api_key_is_enforced_when_configured(tmp_path):
    from urllib.request import urlopen as get

    from tests.support.service import Service, settings_for

    service = Service(settings_for(str(tmp_path / "store")), api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            service.client(api_key="wrong").models.list()
        assert [m.id for m in service.client(api_key="s3cret").models.list()] == [
            "bulkgen-tiny",
            "bulkgen-tools",
        ]
        assert json.loads(get(service.base_url.removesuffix("/v1") + "/health").read())["status"] == "ok"
    finally:
        service.stop()


def _embedding_rows(lines: int, inputs: int) -> list[dict]:
    return [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "bulkgen-tiny", "input": [f"t{j}" for j in range(inputs)]},
        }
        for i in range(lines)
    ]


def test_embedding_inputs_over_openais_limit_fail_the_file_naming_count_line_and_limit(client, tmp_path):
    """OpenAI's limit is 50,000 embedding inputs per batch, summed over its lines (one line's `input` may be
    a list of up to 2,048): 25 lines of 2,048 inputs (51,200) is 25 requests, far under the request limit,
    and fails the file at the line that takes the total past 50,000."""
    rows = _embedding_rows(25, 2048)
    batch = _create(client, write_jsonl(tmp_path / "many.jsonl", rows), endpoint="/v1/embeddings")
    assert batch.status == "failed"
    [error] = batch.errors.data
    assert (error.code, error.line, error.param) == ("too_many_embedding_inputs", 25, "body.input")
    assert "51200" in error.message and "50000" in error.message
    assert "--max-embedding-inputs-per-batch" in error.message


def test_the_embedding_input_limit_counts_every_input_and_is_raised_by_its_setting():
    import io

    from bulkgen.batch.validate import Validator, validate_stream

    def validate(rows, **limit):
        data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
        return validate_stream(io.BytesIO(data), Validator("/v1/embeddings", ["bulkgen-tiny"], 100, **limit))

    rows = _embedding_rows(3, 4) + [{**_embedding_rows(1, 1)[0], "custom_id": "one"}]  # 13 inputs
    rows[-1]["body"]["input"] = "a single string is one input"
    assert validate(rows, max_embedding_inputs=13).ok
    over = validate(rows, max_embedding_inputs=12)
    assert [(e["code"], e["line"]) for e in over.errors] == [("too_many_embedding_inputs", 4)]
    assert validate(_embedding_rows(25, 2048)).errors[0]["code"] == "too_many_embedding_inputs"
    assert validate(_embedding_rows(25, 2048), max_embedding_inputs=60_000).ok
