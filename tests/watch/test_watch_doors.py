"""The watcher's door for the newer model kinds: a job file that serves a model on a tensor-parallel group
(`tensor_parallel: {NAME: 2}`, two gloo ranks) beside a vision-language model on a single worker. Its chat
lines give the single-process engine's greedy text; its image lines run, a corrupt image is its line's 400."""

from __future__ import annotations

import json

import pytest
from transformers import AutoProcessor, AutoTokenizer

from bulkgen.batch.prepare import tokenize
from bulkgen.batch.requests import CHAT, parse_line
from bulkgen.engine import Engine, SamplingParams
from bulkgen.lab.tiny_vision import build_tiny_vlm
from tests.support.images import VLM, data_url, image_tokens, png_url
from tests.support.service import MODEL, chat_row, random_model
from tests.support.watch import rows_jsonl, wait_until

PROMPTS = ["The colours of the sea", "Once upon a time", "Dear team,", "Tea or"]
MAX_TOKENS = 8


def _outputs(outbox, stem: str) -> dict[str, dict]:
    path = outbox / f"{stem}.output.jsonl"
    return {json.loads(line)["custom_id"]: json.loads(line) for line in path.read_text().splitlines()}


def _image_row(custom_id: str, url: str) -> dict:
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return chat_row(custom_id, content, max_tokens=4, model=VLM)  # type: ignore[arg-type]


def _engine_text(rows: list[dict]) -> dict[str, str]:
    """What one process running the model whole answers each chat line (greedy), prepared as workers do."""
    path = random_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenize(parse_line(json.dumps(r), i, CHAT), tokenizer) for i, r in enumerate(rows)]
    outs = Engine.from_pretrained(path).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    )
    return {r["custom_id"]: out.outputs[0].text for r, out in zip(rows, outs, strict=True)}


@pytest.mark.slow
def test_a_job_serves_a_tensor_parallel_model_beside_a_vision_model(tmp_path, watch_process):
    inbox, outbox = tmp_path / "inbox", tmp_path / "outbox"
    inbox.mkdir()
    vlm = build_tiny_vlm(tmp_path / "vlm", "llava", seed=3)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"input: {inbox}\noutput: {outbox}\nendpoint: /v1/chat/completions\ninterval: 1\n"
        f"tensor_parallel: {{{MODEL}: 2}}\n"
    )
    chats = [chat_row(f"tp-{i}", p, max_tokens=MAX_TOKENS) for i, p in enumerate(PROMPTS)]
    images = [_image_row("img-0", png_url((20, 16))), _image_row("img-1", png_url((9, 30), (0, 90, 200)))]
    images.append(_image_row("corrupt", data_url(b"\x89PNG\r\n\x1a\nnot really a png")))
    (inbox / "chats.jsonl").write_bytes(rows_jsonl(chats))
    (inbox / "images.jsonl").write_bytes(rows_jsonl(images))
    # the watcher serves MODEL already (tests/support/watch.py); a command line's --model adds to it
    store = str(tmp_path / "store")
    watcher = watch_process(
        tmp_path / "watch.log", "--job", str(job), "--model", f"{VLM}={vlm}", "--storage", store
    )

    for stem in ("chats", "images"):
        wait_until(
            lambda s=stem: (outbox / f"{s}.summary.json").exists(), 300, f"{stem}.summary.json", watcher
        )
    assert "1 of 1 rank(s), 1 of 2 rank(s)" in watcher.text()  # a single worker and a group of two
    answered = _outputs(outbox, "chats")
    assert sorted(answered) == sorted(f"tp-{i}" for i in range(len(PROMPTS)))
    text = {
        cid: line["response"]["body"]["choices"][0]["message"]["content"] for cid, line in answered.items()
    }
    assert text == _engine_text(chats) and all(text.values())

    ran = _outputs(outbox, "images")
    assert sorted(ran) == ["img-0", "img-1"]
    per_image = image_tokens(AutoProcessor.from_pretrained(vlm))
    for line in ran.values():
        assert line["response"]["status_code"] == 200
        assert line["response"]["body"]["usage"]["prompt_tokens"] > per_image  # the image's tokens counted
    errors = [json.loads(x) for x in (outbox / "images.errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["corrupt"]
    assert errors[0]["response"]["status_code"] == 400
    assert "body.messages[0].content[1].image_url" in json.dumps(errors[0])
