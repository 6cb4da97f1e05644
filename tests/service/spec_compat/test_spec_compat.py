"""A line per field and value of OpenAI's two request schemas (generate.py, checked against the spec's schema),
run through the real service with the openai client: every line either runs (in the output file) or gets its
named 400 in the error file, the batch completes, and what is refused is exactly README's refusal list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bulkgen.batch.endpoints import ENDPOINTS
from tests.service.spec_compat.cases import TOOL, USER
from tests.service.spec_compat.generate import FILES, SCHEMAS, properties, validator
from tests.support.service import TOOLS_MODEL, read_lines, tool_model, upload, wait_done

HERE = Path(__file__).parent
EXPECTED = json.loads((HERE / "expected.json").read_text())
SCHEMA = json.loads((HERE / "request_schemas.json").read_text())
# README "Supported request fields": what a text-only self-hosted model refuses (per-line 400, by param).
DOCUMENTED_REFUSALS = {
    "/v1/chat/completions": {
        "body.stream",
        "body.audio",
        "body.web_search_options",
        "body.moderation",
        "body.modalities",
        "body.tools[0].type",
        "body.messages[0].content[1].type",
        "body.messages[0].content[1].image_url",  # an http(s) host the operator did not allow
        "body.max_tokens",
    },
    "/v1/completions": {"body.stream", "body.suffix"},
}


def _rows(endpoint: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / FILES[endpoint]).read_text().splitlines()]


@pytest.mark.parametrize("endpoint", sorted(FILES))
def test_the_corpus_is_spec_valid_and_covers_every_field(endpoint):
    check = validator(SCHEMA, SCHEMAS[endpoint])
    rows = _rows(endpoint)
    for row in rows:
        assert not list(check.iter_errors(row["body"])), row["custom_id"]
    fields = properties(SCHEMA, SCHEMAS[endpoint])
    assert fields == {row["custom_id"].split(".")[0] for row in rows}
    assert len(fields) == {"/v1/chat/completions": 37, "/v1/completions": 18}[endpoint]
    assert ENDPOINTS[endpoint].fields == fields  # the parser knows exactly the spec's fields


@pytest.fixture(scope="module")
def finished(client):
    """Both corpus batches, submitted together and run to the end: endpoint -> (batch, output, errors)."""
    batches = {
        endpoint: client.batches.create(
            input_file_id=upload(client, HERE / name).id, endpoint=endpoint, completion_window="24h"
        ).id
        for endpoint, name in FILES.items()
    }
    out = {}
    for endpoint, batch_id in batches.items():
        batch = wait_done(client, batch_id, timeout=900)
        out[endpoint] = (
            batch,
            {r["custom_id"]: r for r in read_lines(client, batch.output_file_id)},
            {r["custom_id"]: r for r in read_lines(client, batch.error_file_id)},
        )
    return out


@pytest.fixture(scope="module")
def client(service):
    return service.client()


@pytest.mark.parametrize("endpoint", sorted(FILES))
def test_every_line_runs_or_gets_its_named_400(finished, endpoint):
    batch, output, errors = finished[endpoint]
    expected = EXPECTED[endpoint]
    assert batch.status == "completed", batch.errors
    refused = {cid: e["response"]["body"]["error"]["param"] for cid, e in errors.items()}
    assert refused == {cid: param for cid, param in expected.items() if param is not None}
    assert set(output) == {cid for cid, param in expected.items() if param is None}
    assert all(
        e["response"]["status_code"] == 400 and e["response"]["body"]["error"]["message"]
        for e in errors.values()
    )
    assert set(refused.values()) == DOCUMENTED_REFUSALS[endpoint]
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(expected), len(output), len(refused))


def test_honoured_values_shape_the_answers(finished):
    _, chat, _ = finished["/v1/chat/completions"]
    _, text, _ = finished["/v1/completions"]
    body = {cid: line["response"]["body"] for cid, line in {**chat, **text}.items()}
    assert len(body["n.128"]["choices"]) == 128 and sorted(
        c["index"] for c in body["n.128"]["choices"]
    ) == list(range(128))
    assert len(body["best_of.20"]["choices"]) == 1
    assert body["best_of.20"]["usage"]["completion_tokens"] > body["best_of.1"]["usage"]["completion_tokens"]
    assert body["echo.true"]["choices"][0]["text"].startswith("Once upon")
    assert (
        body["echo.logprobs"]["choices"][0]["logprobs"]["tokens"][0] == "O"
    )  # the prompt's first token leads
    assert len(body["top_logprobs.20"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20
    assert body["max_tokens.0"]["usage"]["completion_tokens"] == 0
    several = sorted(body["prompt.strings-n2-echo"]["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in several] == list(range(6))  # prompt i's choices: i*n .. i*n+n-1
    assert all(
        c["text"].startswith(p)
        for c, p in zip(several, ["Once", "Once", "upon", "upon", "zebra", "zebra"], strict=True)
    )


def test_tool_definitions_reach_the_model_through_its_template(finished):
    """The engine's prompt, counted: exactly the Hermes template's rendering with the tool definitions."""
    from transformers import AutoTokenizer

    _, chat, _ = finished["/v1/chat/completions"]
    tokenizer = AutoTokenizer.from_pretrained(tool_model())

    def prompt_tokens(**kwargs) -> int:
        text = tokenizer.apply_chat_template([USER], add_generation_prompt=True, tokenize=False, **kwargs)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    usage = {cid: line["response"]["body"]["usage"]["prompt_tokens"] for cid, line in chat.items()}
    assert usage["tools.function"] == usage["functions.one"] == prompt_tokens(tools=[TOOL])
    assert usage["tool_choice.none"] == usage["model.served"] == prompt_tokens() < usage["tools.function"]
    assert usage["reasoning_effort.high"] == prompt_tokens(reasoning_effort="high")
    assert chat["tools.function"]["response"]["body"]["model"] == TOOLS_MODEL
