"""Image lines through the real service and the openai client: a bad image refuses its line alone, with a
400 naming the part (found at validation where it can be), and the rest of the batch runs; a file id
uploaded with purpose `vision` is the tenant's image; http URLs are refused unless their host is allowed
(none is, by default). The session's models are text-only, so a well-formed image line gets the 400 that
names its first image part."""

from __future__ import annotations

import io

from tests.support.images import data_url, image_bytes, png_url
from tests.support.service import MODEL, chat_row, read_lines, upload, wait_done, write_jsonl

PART = "body.messages[0].content[1].image_url"


def _image_row(custom_id: str, url: str) -> dict:
    row = chat_row(custom_id, "", max_tokens=4)
    row["body"]["messages"][0]["content"] = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return row


def _responses_row(custom_id: str, **image) -> dict:
    content = [
        {"type": "input_text", "text": "Describe it."},
        {"type": "input_image", "detail": "auto", **image},
    ]
    body = {"model": MODEL, "input": [{"role": "user", "content": content}], "max_output_tokens": 16}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}


def _errors(client, batch) -> dict[str, dict]:
    return {
        line["custom_id"]: line["response"]["body"]["error"]
        for line in read_lines(client, batch.error_file_id)
    }


def test_a_corrupt_image_refuses_its_line_and_the_rest_complete(client, tmp_path):
    rows = [
        chat_row("text-1", "Hello there", max_tokens=4),
        _image_row("corrupt", data_url(b"\x89PNG\r\n\x1a\n but not really a PNG")),
        _image_row("http", "http://images.example/cat.png"),
        _image_row("on-a-text-model", png_url()),
        chat_row("text-2", "Good morning", max_tokens=4),
    ]
    batch = client.batches.create(
        input_file_id=upload(client, write_jsonl(tmp_path / "images.jsonl", rows)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch = wait_done(client, batch.id)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 2, 3)
    assert [line["custom_id"] for line in read_lines(client, batch.output_file_id)] == ["text-1", "text-2"]
    errors = _errors(client, batch)
    assert {cid: (e["code"], e["param"]) for cid, e in errors.items()} == {
        "corrupt": ("invalid_image", PART),
        "http": ("invalid_image_url", PART),
        "on-a-text-model": ("unsupported_parameter", PART),
    }
    assert "is not an image" in errors["corrupt"]["message"]
    assert "--image-url-hosts" in errors["http"]["message"]
    assert "takes text only" in errors["on-a-text-model"]["message"]


def test_responses_input_image_by_file_id_is_the_tenants_vision_file(client, tmp_path):
    png = image_bytes("PNG", (9, 9), (0, 90, 0))
    image = client.files.create(file=("leaf.png", io.BytesIO(png)), purpose="vision")
    assert (image.purpose, image.bytes) == ("vision", len(png))
    batch_file = upload(client, write_jsonl(tmp_path / "other.jsonl", [chat_row("x", "hi")]))
    rows = [
        _responses_row("by-file", file_id=image.id),
        _responses_row("batch-purpose", file_id=batch_file.id),
        _responses_row("no-such-file", file_id="file-doesnotexist"),
        _responses_row("plain", image_url=png_url()),
    ]
    rows[3]["body"]["input"][0]["content"] = "Say hi"  # a text line beside them
    batch = client.batches.create(
        input_file_id=upload(client, write_jsonl(tmp_path / "responses.jsonl", rows)).id,
        endpoint="/v1/responses",
        completion_window="24h",
    )
    batch = wait_done(client, batch.id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 3)
    errors = _errors(client, batch)
    param = "body.input[0].content[1].file_id"
    assert {cid: (e["code"], e["param"]) for cid, e in errors.items()} == {
        "by-file": ("unsupported_parameter", param),  # found and readable: only the text model refuses it
        "batch-purpose": ("invalid_image_url", param),
        "no-such-file": ("invalid_image_url", param),
    }
    assert "purpose 'batch'" in errors["batch-purpose"]["message"]
