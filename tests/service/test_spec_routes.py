"""The spec's routes and shapes around batches: models.retrieve, an empty file page, unknown routes and
methods, Azure OpenAI's line format, long custom_ids, and a file whose only problems are request bodies
run by `bulkgen run` (refused lines in its error file, the rest in its output)."""

from __future__ import annotations

import json
from urllib.error import HTTPError
from urllib.request import Request, urlopen

import openai
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from bulkgen.batch.resultfiles import write_results
from bulkgen.cli import cli
from bulkgen.store import LocalStore
from tests.support.service import MODEL, chat_row, random_model, read_lines, upload, wait_done, write_jsonl


def test_models_retrieve_and_unknown_model_404(client):
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "bulkgen")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-no-such")
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert info.value.body["message"].startswith("The model 'gpt-no-such' does not exist")


def test_an_empty_file_page_has_string_ids(client):
    page = client.files.with_raw_response.list(purpose="fine-tune").http_response.json()
    assert page == {"object": "list", "data": [], "first_id": "", "last_id": "", "has_more": False}


def test_bulkgen_run_refuses_body_errors_line_by_line(tmp_path, monkeypatch):
    monkeypatch.setenv("BULKGEN_DEFAULT_MODEL", str(random_model()))
    rows = [
        chat_row("ok-1", "hi", max_tokens=2),
        chat_row("hot", "hi", temperature=9),
        chat_row("null-t", "hi", max_tokens=2, temperature=None, top_p=None),
        chat_row(
            "json",
            "hi",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "integer", "minimum": 5, "maximum": 1}},
            },
        ),
        chat_row("ok-2", "hi", max_tokens=2),
    ]
    result = CliRunner().invoke(
        cli,
        [
            "run",
            str(write_jsonl(tmp_path / "in.jsonl", rows)),
            "--output",
            str(tmp_path / "o.jsonl"),
            "--storage",
            str(tmp_path / "store"),
        ],
    )
    assert "3 completed, 2 failed" in result.output, result.output
    done = [json.loads(line)["custom_id"] for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    errors = {
        e["custom_id"]: e["response"]["body"]["error"]["param"]
        for e in map(json.loads, (tmp_path / "o.errors.jsonl").read_text().splitlines())
    }
    assert sorted(done) == ["null-t", "ok-1", "ok-2"]
    assert errors == {"hot": "body.temperature", "json": "body.response_format"}


def _raw(service, method: str, path: str) -> tuple[int, dict, dict]:
    request = Request(service.base_url.removesuffix("/v1") + path, method=method)
    try:
        with urlopen(request) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def test_unknown_routes_and_methods_answer_in_openai_shape(service):
    status, _, body = _raw(service, "GET", "/v1/no-such-route")
    assert (status, body) == (
        404,
        {
            "error": {
                "message": "Invalid URL (GET /v1/no-such-route)",
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        },
    )
    for method, path, allow in [
        ("DELETE", "/v1/files", "GET, POST"),  # two routes on one path: both named
        ("PUT", "/v1/batches/batch_x", "GET"),
        ("GET", "/v1/batches/batch_x/cancel", "POST"),
    ]:
        status, headers, body = _raw(service, method, path)
        assert (status, headers["allow"], body["error"]["code"]) == (405, allow, "method_not_allowed"), path
        assert body["error"]["message"] == f"Method not allowed ({method} {path}); this path takes {allow}"


def test_azure_lines_and_long_custom_ids_run(service, client, tmp_path):
    """Azure OpenAI writes `url` (and the batch's endpoint) without /v1; OpenAI sets no length on
    custom_id. Both run, the ids come back whole in the output, the error file and a Parquet output."""
    path_id = "judge/meta-llama/Llama-3.1-8B-Instruct/checkpoints/step-1200/prompt-000017/sample-3"
    wide_id = "é" * 512  # 1,024 bytes of UTF-8: the limit
    rows = [{**chat_row(cid, "hi", max_tokens=2), "url": "/chat/completions"} for cid in (path_id, wide_id)]
    refused = [chat_row("extra-key", "hi"), chat_row("image", "hi")]
    refused[0]["body"]["messages"][0]["cache_control"] = {"type": "ephemeral"}  # not OpenAI's: refused
    refused[1]["body"]["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": "x"}}]
    batch = client.batches.create(
        input_file_id=upload(client, write_jsonl(tmp_path / "azure.jsonl", rows + refused)).id,
        endpoint="/chat/completions",
        completion_window="24h",
    )
    assert batch.endpoint == "/v1/chat/completions"
    batch = wait_done(client, batch.id)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 2, 2)
    assert [line["custom_id"] for line in read_lines(client, batch.output_file_id)] == [path_id, wide_id]
    errors = {
        line["custom_id"]: line["response"]["body"]["error"]
        for line in read_lines(client, batch.error_file_id)
    }
    assert (errors["extra-key"]["code"], errors["extra-key"]["param"]) == (
        "unknown_parameter",
        "body.messages[0].cache_control",
    )
    assert "body.messages[0].content[0].image_url must be a data: URL" in errors["image"]["message"]
    out = LocalStore(tmp_path / "out", fsync=False)
    out.create()
    (key, _) = write_results(service.svc, service.svc.batches.get(batch.id), out, "azure", "parquet")
    table = pq.read_table(out.root / key)
    assert sorted(table.column("custom_id").to_pylist()) == sorted([path_id, wide_id, "extra-key", "image"])
