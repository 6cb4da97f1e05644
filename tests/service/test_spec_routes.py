"""The spec's routes and shapes around batches: models.retrieve, an empty file page, and a file whose only
problems are request bodies run by `bulkgen run` (refused lines in its error file, the rest in its output)."""

from __future__ import annotations

import json

import openai
import pytest
from click.testing import CliRunner

from bulkgen.cli import cli
from tests.support.service import MODEL, chat_row, random_model, write_jsonl


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
