"""`bulkgen run --tensor-parallel tp-tiny=2` (one worker of two gloo ranks on a local Ray) returns, line for
line, the text of the same chat file run by a single-process worker (greedy)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from bulkgen.cli import cli
from bulkgen.lab.tiny import build_tiny_model
from tests.support.service import write_jsonl

NAME = "tp-tiny"


def _rows() -> list[dict]:
    texts = [
        "The colours of the sea",
        "Once upon a time",
        "Q: two plus two?\nA:",
        "Dear team,",
        "Tea or",
        "A",
    ]
    return [
        {
            "custom_id": f"chat-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": NAME,
                "messages": [{"role": "user", "content": t}],
                "max_tokens": 12,
                "temperature": 0,
            },
        }
        for i, t in enumerate(texts)
    ]


def _run(tmp_path, model, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.out.jsonl"
    rows = _rows()
    args = ["run", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--output", str(out)]
    args += ["--storage", str(tmp_path / f"store-{name}"), "--model", f"{NAME}={model}", *extra]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert f"{len(rows)} completed, 0 failed" in result.output, result.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    return {x["custom_id"]: _text(x["response"]["body"]) for x in lines}


def _text(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def test_bulkgen_run_with_two_ranks_gives_the_single_process_text(tmp_path):
    model = build_tiny_model(tmp_path / "model", "llama", seed=7)
    single = _run(tmp_path, model, "single")
    # the model named (the N form, every model, is parsed in test_settings_flags and run in the worker test)
    sharded = _run(tmp_path, model, "tp2", "--tensor-parallel", f"{NAME}=2")
    assert sharded == single
    assert all(single.values())  # every line generated text: a comparison of empty strings proves nothing
