"""Retry of failed lines (POST /v1/batches/{id}/retry, `bulkgen retry`) and `bulkgen results --merged`.

Through the session's real service and the real openai client: a batch whose window passed before it ran
(every line batch_expired) is retried whole and its retry succeeds; a cancelled batch is retried with only
its cancelled lines, never its 400s or its successes; the links go both ways; merged results hold each
custom_id once, in input order.
"""

from __future__ import annotations

import io
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from click.testing import CliRunner
from openai.types import Batch

from bulkgen.batch.batchrecord import new_batch_record
from bulkgen.batch.merged import merge_chain
from bulkgen.batch.outputlines import envelope, not_run_line, refused_line
from bulkgen.batch.retry import retryable
from bulkgen.cli import cli
from bulkgen.tenants import KeyRing, add_key
from tests.support.held_engine import HOLD
from tests.support.service import (
    Service,
    chat_row,
    read_lines,
    settings_for,
    upload,
    wait_done,
    wait_for,
    write_jsonl,
)


def _retry(client, batch_id: str) -> Batch:
    return client.post(f"/batches/{batch_id}/retry", cast_to=Batch)


def _invoke(service, *args):
    return CliRunner().invoke(cli, [*args, "--base-url", service.base_url, "--api-key", "k"])


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _expired_before_it_ran(
    service, client, tmp_path, rows: list[dict], metadata: dict | None = None
) -> Batch:
    """A batch whose completion window passed before any runner took it: created as the service creates
    one, with its expires_at already behind (the record is the source of truth), then indexed."""
    file_id = upload(client, write_jsonl(tmp_path / "expired.jsonl", rows)).id
    record = new_batch_record(file_id, "/v1/chat/completions", "24h", metadata or {"job": "nightly"})
    record.expires_at = record.created_at - 1
    record.internal["output_expires_after_s"] = 7200  # what output_expires_after={seconds: 7200} stores
    service.svc.batches.create(record)
    service.svc.ensure_indexed(record.id)
    service.manager.wake()
    return wait_done(client, record.id)


def test_an_expired_batch_is_retried_and_merged_with_its_retry(service, client, tmp_path):
    rows = [chat_row(f"ok-{i}", f"label {i}", max_tokens=2) for i in range(4)]
    rows.insert(2, chat_row("too-long", "x", max_tokens=100_000))
    first = _expired_before_it_ran(service, client, tmp_path, rows)
    assert first.status == "expired" and first.output_file_id is None
    assert {e["error"]["code"] for e in read_lines(client, first.error_file_id)} == {"batch_expired"}

    made = _invoke(service, "retry", first.id, "--wait", "--output", str(tmp_path / "retry.jsonl"))
    assert made.exit_code == 0, made.output
    second = client.batches.retrieve(made.output.split()[0])
    assert (
        f"(5 requests, retrying {first.id})" in made.output
        and "completed: 4 completed, 1 failed" in made.output
    )
    assert len(_jsonl(tmp_path / "retry.jsonl")) == 4 and len(_jsonl(tmp_path / "retry.errors.jsonl")) == 1
    assert second.metadata == {"job": "nightly"} and second.model_extra["retry_of"] == first.id
    linked = client.batches.retrieve(first.id)
    assert linked.metadata == {"job": "nightly"} and linked.model_extra["retried_by"] == second.id
    assert (second.endpoint, second.completion_window) == (first.endpoint, first.completion_window)
    retried = client.files.content(second.input_file_id).text.splitlines()
    assert [json.loads(line) for line in retried] == rows  # never run, so every line, the 400-to-be too
    assert second.status == "completed" and second.model == first.model
    output = client.files.retrieve(second.output_file_id)
    assert (
        output.expires_at is not None and output.expires_at - output.created_at == 7200
    )  # kept from the first
    assert (second.request_counts.completed, second.request_counts.failed) == (4, 1)
    with pytest.raises(
        openai.BadRequestError,
        match="nothing to retry: 4 requests succeeded and 1 failed with request errors",
    ) as info:
        _retry(client, second.id)
    assert info.value.body["code"] == "nothing_to_retry"
    with pytest.raises(openai.ConflictError, match=f"already retried by {second.id}"):
        _retry(client, first.id)

    for start in (first.id, second.id):  # from either end of the chain: the same merge
        out = tmp_path / f"merged-{start}.jsonl"
        result = _invoke(service, "results", start, "--merged", str(out))
        assert result.exit_code == 0, result.output
        assert f"across {first.id} -> {second.id}" in result.output
        merged = _jsonl(out)
        assert [m["custom_id"] for m in merged] == [f"ok-{i}" for i in range(4)]
        assert all(m["response"]["status_code"] == 200 for m in merged)
        (error,) = _jsonl(tmp_path / f"merged-{start}.errors.jsonl")
        assert error["custom_id"] == "too-long"  # its newest error: the 400 of the retry, not batch_expired
        assert error["response"]["body"]["error"]["code"] == "context_length_exceeded"


def test_concurrent_retries_make_one_batch_and_keep_the_metadata_to_16_pairs(service, client, tmp_path):
    """Ten retries of one batch at once: one wins before anything is made; the nine others answer 409 and
    leave no batch or file behind. The links are fields, so a batch with OpenAI's 16 metadata pairs is
    retried with the same 16."""
    metadata = {f"k{i:02d}": f"v{i}" for i in range(16)}
    first = _expired_before_it_ran(
        service, client, tmp_path, [chat_row(f"c{i}", "hi", max_tokens=2) for i in range(3)], metadata
    )
    start = threading.Barrier(10)

    def retry(_):
        start.wait()
        try:
            return _retry(client, first.id)
        except openai.APIStatusError as exc:
            return exc

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(retry, range(10)))
    made = [a for a in answers if isinstance(a, Batch)]
    refused = [a for a in answers if not isinstance(a, Batch)]
    assert len(made) == 1, answers
    assert [(e.status_code, e.body["code"]) for e in refused] == [(409, "already_retried")] * 9
    (second,) = made
    retry_files = [f.id for f in client.files.list() if f.filename == f"{first.id}_retry.jsonl"]
    assert retry_files == [second.input_file_id]
    assert [b.id for b in client.batches.list(limit=100) if b.input_file_id in retry_files] == [second.id]
    assert client.batches.retrieve(first.id).model_extra["retried_by"] == second.id
    assert second.metadata == metadata and second.model_extra["retry_of"] == first.id
    assert wait_done(client, second.id).status == "completed"


def test_a_cancelled_batch_retries_only_what_did_not_run(service, client, tmp_path, engine_gate):
    rows = [chat_row(f"ok-{i}", f"label {i}", max_tokens=2) for i in range(3)]
    rows.insert(1, chat_row("too-long", "x", max_tokens=100_000))
    rows += [
        chat_row(f"slow-{i}", f"{HOLD} story {i}", max_tokens=64) for i in range(2)
    ]  # held until cancelled
    file_id = upload(client, write_jsonl(tmp_path / "mixed.jsonl", rows)).id
    first = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(client, first.id, lambda b: (b.request_counts.completed, b.request_counts.failed) == (3, 1))
    client.batches.cancel(first.id)
    first = wait_done(client, first.id)
    assert first.status == "cancelled"

    second = _retry(client, first.id)
    second_id = second.id
    assert (
        second.status == "validating"
        and second.metadata is None
        and second.model_extra["retry_of"] == first.id
    )
    retried = [
        json.loads(line)["custom_id"] for line in client.files.content(second.input_file_id).text.splitlines()
    ]
    assert retried == ["slow-0", "slow-1"]  # not the successes, not the 400
    assert client.batches.retrieve(first.id).model_extra["retried_by"] == second_id

    with pytest.raises(
        openai.ConflictError, match=f"batch {second_id} is (validating|in_progress); retry it once"
    ):
        _retry(client, second_id)
    early = _invoke(service, "results", first.id, "--merged", str(tmp_path / "early.jsonl"))
    assert early.exit_code == 1 and f"batch {second_id} of the retry chain is still running" in early.output
    client.batches.cancel(second_id)
    second = wait_done(client, second_id)

    out = tmp_path / "merged.jsonl"
    assert _invoke(service, "results", first.id, "--merged", str(out)).exit_code == 0
    assert [m["custom_id"] for m in _jsonl(out)] == ["ok-0", "ok-1", "ok-2"]
    errors = _jsonl(tmp_path / "merged.errors.jsonl")
    assert [e["custom_id"] for e in errors] == ["too-long", "slow-0", "slow-1"]
    newest = {e["id"] for e in read_lines(client, second.error_file_id)}
    assert {e["id"] for e in errors[1:]} == newest  # the retry's batch_cancelled lines, not the first's


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    root = tmp_path_factory.mktemp("retry-tenants")
    key_a, key_b = add_key(root / "keys", "team-a"), add_key(root / "keys", "team-b")
    service = Service(settings_for(str(root / "store")), keyring=KeyRing.from_file(root / "keys"))
    yield service.client(key_a), service.client(key_b)
    service.stop()  # the workers are the session's: they stay up, loaded, for the next tests


def test_another_tenant_cannot_retry_and_a_failed_validation_is_not_retried(keyed, tmp_path):
    team_a, team_b = keyed
    rows = [
        {**chat_row("a", "hi"), "url": "/v1/completions"}
    ]  # a url other than the batch's: fails validation
    file_id = upload(team_a, write_jsonl(tmp_path / "bad.jsonl", rows)).id
    batch = team_a.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert wait_done(team_a, batch.id).status == "failed"
    with pytest.raises(openai.NotFoundError):
        _retry(team_b, batch.id)
    with pytest.raises(openai.BadRequestError, match="failed validation, so none of its requests ran"):
        _retry(team_a, batch.id)
    assert team_a.batches.retrieve(batch.id).model_extra["retried_by"] is None  # nothing linked


def test_retryable_codes_follow_what_the_runtime_writes():
    assert retryable(refused_line("a", "the engine failed on this request: CUDA error", "engine_error"))
    assert retryable(not_run_line("a", "batch_expired")) and retryable(not_run_line("a", "batch_cancelled"))
    assert not retryable(refused_line("a", "too long", "context_length_exceeded", "body.max_tokens"))
    assert not retryable(refused_line("a", "bad", "invalid_parameter", "body.temperature"))


def _lines(*envelopes: dict) -> list[bytes]:
    return [json.dumps(e).encode() for e in envelopes]


def test_merge_takes_the_newest_success_else_the_last_error():
    source = _lines(*({"custom_id": c} for c in ("a", "b", "c", "d")))
    ok = {c: envelope(c, {"status_code": 200, "body": {"n": c}}, None) for c in "abcd"}
    first = (
        _lines(ok["a"]),
        _lines(
            not_run_line("b", "batch_expired"),
            not_run_line("c", "batch_expired"),
            refused_line("d", "bad", "invalid_parameter"),
        ),
    )
    second = (_lines(ok["b"]), _lines(refused_line("c", "the engine failed", "engine_error")))
    third = ([], [])  # a chain's last batch that failed while running: no result files
    out, err = io.BytesIO(), io.BytesIO()
    counts = merge_chain(source, [first, second, third], out, err)
    assert (counts.succeeded, counts.failed) == (2, 2)
    assert [json.loads(x)["custom_id"] for x in out.getvalue().splitlines()] == ["a", "b"]
    errors = [json.loads(x) for x in err.getvalue().splitlines()]
    assert [(e["custom_id"], e["response"]["body"]["error"]["code"]) for e in errors] == [
        ("c", "engine_error"),
        ("d", "invalid_parameter"),
    ]
    with pytest.raises(ValueError, match="'b' of a result file is not in the input"):
        merge_chain(source[:1], [first, second], io.BytesIO(), io.BytesIO())
    gone = io.BytesIO()
    merge_chain(source[:1], [([], [])], io.BytesIO(), gone)
    assert json.loads(gone.getvalue())["error"]["code"] == "no_result"
