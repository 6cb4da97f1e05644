"""The official openai package against a real bulkgen server: files, batches, results, usage."""

from __future__ import annotations

import json
import re
from urllib.request import urlopen

import openai
import pytest

from tests.support.service import (
    MODEL,
    SAMPLES,
    TOOLS_MODEL,
    chat_row,
    random_model,
    read_lines,
    upload,
    validated,
    wait_done,
    write_jsonl,
)

pytestmark = pytest.mark.upstream  # also on the lower bound and the canary (README: tested ranges)


@pytest.mark.parametrize("sample", ["chat.jsonl", "completions.jsonl"])
def test_sample_batch_completes_with_one_output_line_per_request(client, sample):
    path = SAMPLES / sample
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    uploaded = upload(client, path)
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=rows[0]["url"],
        completion_window="24h",
        metadata={"team": "evals"},
    )
    assert batch.status == "validating" and batch.in_progress_at is None
    batch = validated(client, batch.id)
    assert batch.status in ("in_progress", "finalizing", "completed") and batch.request_counts.total == len(
        rows
    )
    batch = wait_done(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == len(rows) and batch.request_counts.failed == 0
    assert batch.error_file_id is None and batch.metadata == {"team": "evals"}
    for stamp in ("created_at", "in_progress_at", "finalizing_at", "completed_at"):
        assert getattr(batch, stamp) is not None
    lines = read_lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in lines] == [
        r["custom_id"] for r in rows
    ]  # exactly once, input order
    kind = "chat.completion" if sample == "chat.jsonl" else "text_completion"
    prompt_tokens = completion_tokens = 0
    for line, row in zip(lines, rows, strict=True):
        body = line["response"]["body"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert body["object"] == kind and body["model"] == MODEL
        assert 1 <= body["usage"]["completion_tokens"] <= row["body"]["max_tokens"]
        prompt_tokens += body["usage"]["prompt_tokens"]
        completion_tokens += body["usage"]["completion_tokens"]
    assert batch.usage.input_tokens == prompt_tokens and batch.usage.output_tokens == completion_tokens
    fingerprints = {line["response"]["body"]["system_fingerprint"] for line in lines}
    assert len(fingerprints) == 1 and fingerprints.pop().startswith("fp_")  # one for the whole batch
    metrics = batch.model_extra["metrics"]
    assert metrics["output_tokens"] == completion_tokens and metrics["ttft_s"]["p50"] > 0
    assert 0 < metrics["slot_efficiency"] <= 1


def test_shared_system_prompt_reports_cached_tokens(client, tmp_path):
    system = "You label support tickets. " * 8
    rows = [chat_row(f"r{i}", f"ticket {i}") for i in range(6)]
    for row in rows:
        row["body"]["messages"].insert(0, {"role": "system", "content": system})
    batch = client.batches.create(
        input_file_id=upload(client, write_jsonl(tmp_path / "p.jsonl", rows)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch = wait_done(client, batch.id)
    assert batch.status == "completed"
    assert batch.usage.input_tokens_details.cached_tokens > 0


def test_greedy_chat_output_is_deterministic_and_matches_the_engine(client, tmp_path):
    from bulkgen.engine import Engine, SamplingParams

    rows = [chat_row("a", "The quick brown fox", max_tokens=12), chat_row("b", "jumps over", max_tokens=5)]
    batch = client.batches.create(
        input_file_id=upload(client, write_jsonl(tmp_path / "g.jsonl", rows)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    lines = read_lines(client, wait_done(client, batch.id).output_file_id)
    engine = Engine.from_pretrained(str(random_model()))
    tok = engine.tokenizer
    prompts = [
        tok.apply_chat_template(r["body"]["messages"], add_generation_prompt=True, tokenize=False)
        for r in rows
    ]
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    expected = engine.generate(
        ids, [SamplingParams(max_tokens=12, temperature=0), SamplingParams(max_tokens=5, temperature=0)]
    )
    got = [line["response"]["body"]["choices"][0]["message"]["content"] for line in lines]
    assert got == [o.text for o in expected]


def test_request_options_logprobs_n_and_context_limit(client, tmp_path):
    rows = [
        chat_row("logprobs", "hello", max_tokens=4, logprobs=True, top_logprobs=2),
        chat_row("n2", "abc", max_tokens=3, n=2, temperature=0.8, seed=5),
        chat_row("too-long", "x", max_tokens=100_000),
        chat_row("no-limit", "word " * 5000, max_tokens=None),  # the prompt alone is past the context
    ]
    batch = client.batches.create(
        input_file_id=upload(client, write_jsonl(tmp_path / "o.jsonl", rows)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch = wait_done(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 2)
    out = {line["custom_id"]: line["response"]["body"] for line in read_lines(client, batch.output_file_id)}
    content = out["logprobs"]["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)
    assert [c["index"] for c in out["n2"]["choices"]] == [0, 1]
    assert out["n2"]["usage"]["completion_tokens"] == 6
    error, no_limit = (line["response"]["body"]["error"] for line in read_lines(client, batch.error_file_id))
    assert (error["code"], error["param"]) == ("context_length_exceeded", "body.max_tokens")
    assert re.fullmatch(
        r"This model's maximum context length is 4096 tokens\. However, you requested 100\d{3} tokens "
        r"\(\d+ in the messages, 100000 in the completion\)\. Please reduce the length of the messages "
        r"or completion\.",
        error["message"],
    ), error["message"]
    assert (no_limit["code"], no_limit["param"]) == ("context_length_exceeded", "body.messages")
    assert re.fullmatch(  # no max_tokens: no completion to count (never a negative one)
        r"This model's maximum context length is 4096 tokens\. However, your messages resulted in "
        r"\d{4,} tokens\. Please reduce the length of the messages\.",
        no_limit["message"],
    ), no_limit["message"]


def test_files_api_list_retrieve_content_delete(client, tmp_path):
    ids = [
        upload(client, write_jsonl(tmp_path / f"f{i}.jsonl", [chat_row(f"x{i}", "hi")])).id for i in range(3)
    ]
    newest_first = [f.id for f in client.files.list(limit=2, purpose="batch") if f.id in ids]
    assert newest_first == ids[::-1]  # the pager follows has_more/after across pages
    oldest_first = [f.id for f in client.files.list(order="asc", purpose="batch") if f.id in ids]
    assert oldest_first == ids
    meta = client.files.retrieve(ids[0])
    assert meta.filename == "f0.jsonl" and meta.purpose == "batch" and meta.bytes > 0
    assert json.loads(client.files.content(ids[0]).text)["custom_id"] == "x0"
    assert client.files.delete(ids[0]).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(ids[0])


def test_batches_list_pages_newest_first(client, tmp_path):
    file_id = upload(client, write_jsonl(tmp_path / "l.jsonl", [chat_row("l", "hi", max_tokens=1)])).id
    created = [
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    listed = [b.id for b in client.batches.list(limit=1)]
    assert [b for b in listed if b in created] == created[::-1]
    for batch_id in created:
        wait_done(client, batch_id)


def test_models_health_and_prometheus(service, client, tmp_path):
    assert [m.id for m in client.models.list()] == [MODEL, TOOLS_MODEL]
    file_id = upload(client, write_jsonl(tmp_path / "p.jsonl", [chat_row("p", "hi", max_tokens=2)])).id
    wait_done(
        client,
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id,
    )
    root = service.base_url.removesuffix("/v1")
    assert json.loads(urlopen(f"{root}/health").read())["status"] == "ok"
    text = urlopen(f"{root}/metrics").read().decode()
    assert 'bulkgen_batches{status="completed"}' in text and "bulkgen_queue_batches" in text
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values['bulkgen_requests{outcome="completed"}'] >= 1
    assert values['bulkgen_tokens{kind="output"}'] >= 1
    assert values['bulkgen_worker_busy_seconds{worker="bulkgen-worker-0"}'] > 0
