"""Each door reads and parses an input line once in this process: validation builds the line index in the
same streamed pass, and the runner runs from that index (bulkgen.runtime.driver). The worker that runs a
line parses it once more, in its own process, from its ranged read: the driver never holds the file.

The JSON read of a line is wrapped in the request parser's module, which every reader of an input line
goes through (validation, a file's endpoint from its first line, a job's defaults), so every parse in this
process counts, through the real doors: the API (the session's service), `bulkgen run`, jobs/batch_job.py's run_stored and
the watcher, all on the session's Ray workers.
"""

from __future__ import annotations

import io
import json
from collections import Counter

import pytest
from click.testing import CliRunner

import bulkgen.batch.requests as requests
import bulkgen.runtime.driver as driver
import bulkgen.runtime.manager  # noqa: F401  (loaded before the parser is wrapped: the runner and its index)
from bulkgen.batch.service import BatchService
from bulkgen.cli import cli
from bulkgen.cli.oneshot import run_stored
from bulkgen.watch.job import Job
from bulkgen.watch.watcher import Watcher
from tests.support.service import MODEL, chat_row, random_model, settings_for, upload, wait_done, write_jsonl

LINES = 4


@pytest.fixture
def parses(monkeypatch) -> Counter:
    """custom_id -> how many times its input line was parsed (its JSON read) in this process: by the
    request parser, or to find the file's endpoint or fill a job's defaults."""
    counts: Counter = Counter()
    original = requests.load

    def counting(raw):
        value, cut = original(raw)
        if isinstance(value, dict) and "body" in value:  # an input line, not a result line
            counts[value.get("custom_id")] += 1
        return value, cut

    monkeypatch.setattr(requests, "load", counting)
    return counts


def batch_file(tmp_path, door: str):
    rows = [chat_row(f"{door}-{i}", f"hello {i}", max_tokens=2) for i in range(LINES)]
    return write_jsonl(tmp_path / f"{door}.jsonl", rows)


def parsed_once(parses: Counter, door: str) -> bool:
    return {k: v for k, v in parses.items() if k.startswith(f"{door}-")} == {
        f"{door}-{i}": 1 for i in range(LINES)
    }


@pytest.mark.parametrize("at_create", [False, True], ids=["runner-validates", "refuse-infeasible"])
def test_api_parses_each_line_once(service, parses, tmp_path, monkeypatch, at_create):
    """Validated by the runner, or at create (`--refuse-infeasible`) and handed over with its index."""
    monkeypatch.setattr(service.svc.settings, "refuse_infeasible", at_create)
    client = service.client()
    door = f"api{int(at_create)}"
    batch = client.batches.create(
        input_file_id=upload(client, batch_file(tmp_path, door)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert wait_done(client, batch.id).request_counts.completed == LINES
    assert parsed_once(parses, door), parses


def test_run_parses_each_line_once(service, parses, tmp_path):
    result = CliRunner().invoke(
        cli,
        [
            "run",
            str(batch_file(tmp_path, "run")),
            "--output",
            str(tmp_path / "o.jsonl"),
            "--storage",
            str(tmp_path / "store"),
            "--model",
            f"{MODEL}={random_model()}",
        ],
    )
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == LINES
    assert parsed_once(parses, "run"), parses


def test_stored_job_parses_each_line_once(service, parses, tmp_path):
    settings = settings_for(str(tmp_path / "store"))
    BatchService(settings).store.write_bytes("inbox/job.jsonl", batch_file(tmp_path, "job").read_bytes())
    record = run_stored(settings, "inbox/job.jsonl", "outbox", echo=lambda _: None)
    assert record.request_counts.completed == LINES
    assert (tmp_path / "store" / "outbox" / "job.output.jsonl").read_text().count("\n") == LINES
    assert parsed_once(parses, "job"), parses


def test_watcher_parses_each_line_once(service, parses, tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    batch_file(inbox, "watch")
    watcher = Watcher(
        BatchService(settings_for(str(tmp_path / "store"))),
        Job(input=str(inbox), output=str(tmp_path / "outbox")),
    )
    watcher.run(once=True)
    assert (tmp_path / "outbox" / "watch.output.jsonl").read_text().count("\n") == LINES
    assert parsed_once(parses, "watch"), parses


@pytest.mark.parametrize("at_create", [False, True], ids=["runner-validates", "refuse-infeasible"])
def test_api_creates_through_the_driver(service, tmp_path, monkeypatch, at_create):
    """POST /v1/batches is Driver.create over the server's runtime: its accept creates the record."""
    monkeypatch.setattr(service.svc.settings, "refuse_infeasible", at_create)
    accepted = []
    original = driver.Driver.accept

    def counting(self, file_id, *args, **kwargs):
        accepted.append(file_id)
        return original(self, file_id, *args, **kwargs)

    monkeypatch.setattr(driver.Driver, "accept", counting)
    client = service.client()
    file_id = upload(client, batch_file(tmp_path, f"create{int(at_create)}")).id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert accepted == [file_id]
    assert wait_done(client, batch.id).request_counts.completed == LINES


def test_watcher_fills_job_defaults_in_the_one_parse_of_each_line(service, parses, tmp_path):
    """A job's url and body defaults are set in the pass that stores and validates the file: each line is
    parsed once, and the stored input file holds the lines as filled (what ran is what is stored)."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    rows = [chat_row(f"fill-{i}", f"hello {i}") for i in range(LINES)]
    for row in rows:  # what the job fills in: the url, the model and max_tokens
        del row["url"], row["body"]["model"], row["body"]["max_tokens"]
    write_jsonl(inbox / "fill.jsonl", rows)
    spec = Job(
        input=str(inbox),
        output=str(tmp_path / "outbox"),
        model=MODEL,
        endpoint="/v1/chat/completions",
        defaults={"max_tokens": 1},
    )
    svc = BatchService(settings_for(str(tmp_path / "store")))
    Watcher(svc, spec).run(once=True)
    outputs = [json.loads(line) for line in (tmp_path / "outbox" / "fill.output.jsonl").open()]
    assert sorted(o["custom_id"] for o in outputs) == [f"fill-{i}" for i in range(LINES)]
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 1 for o in outputs)
    assert parsed_once(parses, "fill"), parses
    summary = json.loads((tmp_path / "outbox" / "fill.summary.json").read_text())
    with svc.files.open(svc.batches.get(summary["batch"]["id"]).input_file_id) as stored:
        lines = [json.loads(line) for line in stored.read().splitlines()]
    assert [(line["url"], line["body"]["model"], line["body"]["max_tokens"]) for line in lines] == [
        ("/v1/chat/completions", MODEL, 1)
    ] * LINES


def test_a_file_whose_first_line_names_no_endpoint_is_no_batch(tmp_path):
    """Without an endpoint, the first request line's url is the batch's, read in the one parse of that
    line; a file where it cannot be is no batch file, named by file and line. With an endpoint, such a
    line is a validation error like any other, except in an object a watcher found."""
    svc = BatchService(settings_for(str(tmp_path / "store")))
    cases = [
        (b"oops\n", "f.jsonl:1: not a JSON object"),
        (b'\n{"custom_id": "a", "body": {"model": "m"}}\n', "f.jsonl:2: no 'url' field"),
        (b"\n \n", "f.jsonl: the file has no request lines"),
    ]
    for text, message in cases:
        with pytest.raises(requests.NotABatchFile) as err:
            driver.Driver(svc).store_checked(io.BytesIO(text), "f.jsonl", None)
        assert err.value.at("f.jsonl").startswith(message), err.value.at("f.jsonl")
    _, checked = driver.Driver(svc).store_checked(io.BytesIO(b"oops\n"), "f.jsonl", requests.CHAT)
    assert [e["code"] for e in checked.result.errors] == ["invalid_json_line"]
    with pytest.raises(requests.NotABatchFile):
        driver.Driver(svc).store_checked(io.BytesIO(b"oops\n"), "f.jsonl", requests.CHAT, found=True)
    _, checked = driver.Driver(svc).store_checked(
        io.BytesIO(batch_file(tmp_path, "e").read_bytes()), "e", None
    )
    assert checked.endpoint == requests.CHAT and checked.result.ok and len(checked.builder) == LINES
