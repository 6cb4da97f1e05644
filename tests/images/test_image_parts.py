"""Image parts as the chat and Responses front doors parse them: placeholders in the messages, references in
order on the request, and every malformed shape refused as that line's 400 naming the part."""

from __future__ import annotations

import json

import pytest

from bulkgen.batch.requests import CHAT, RESPONSES, LineError, parse_line
from tests.support.images import png_url

PART = "body.messages[0].content[1]"


def _chat(*parts, role: str = "user") -> dict:
    content = [{"type": "text", "text": "What is this?"}, *parts]
    return {
        "custom_id": "a",
        "url": CHAT,
        "body": {"model": "m", "messages": [{"role": role, "content": content}]},
    }


def _responses(*parts, role: str = "user") -> dict:
    content = [{"type": "input_text", "text": "What is this?"}, *parts]
    return {
        "custom_id": "a",
        "url": RESPONSES,
        "body": {"model": "m", "input": [{"role": role, "content": content}]},
    }


def _parse(row: dict):
    return parse_line(json.dumps(row), 1, row["url"])


def _refused(row: dict) -> tuple[str, str, str]:
    with pytest.raises(LineError) as info:
        _parse(row)
    return info.value.code, info.value.param, info.value.message


def test_chat_image_parts_become_placeholders_and_references_in_order():
    first, second = png_url(color=(1, 2, 3)), "https://images.example/cat.png"
    row = _chat(
        {"type": "image_url", "image_url": {"url": first}},
        {"type": "text", "text": " and this?"},
        {"type": "image_url", "image_url": {"url": second, "detail": "low"}},
    )
    request = _parse(row)
    assert request.messages == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image"},
                {"type": "text", "text": " and this?"},
                {"type": "image"},
            ],
        }
    ]
    assert [(r.source, r.detail, r.param, r.kind) for r in request.images] == [
        (first, "auto", f"{PART}.image_url", "data"),
        (second, "low", "body.messages[0].content[3].image_url", "http"),
    ]


def test_text_only_lines_keep_string_content():
    row = _chat()
    assert _parse(row).messages[0]["content"] == "What is this?"
    assert _parse(row).images == []
    assert _parse(_responses()).messages[0]["content"] == "What is this?"


def test_responses_input_image_by_url_and_by_file_id():
    request = _parse(
        _responses(
            {"type": "input_image", "image_url": png_url(), "detail": "high"},
            {"type": "input_image", "file_id": "file-abc123", "detail": "original"},
        )
    )
    assert request.messages[0]["content"][1:] == [{"type": "image"}, {"type": "image"}]
    assert [(r.kind, r.detail, r.param) for r in request.images] == [
        ("data", "high", "body.input[0].content[1].image_url"),
        ("file", "original", "body.input[0].content[2].file_id"),
    ]


@pytest.mark.parametrize(
    "part, code, param",
    [
        ({"type": "image_url"}, "invalid_messages", f"{PART}.image_url"),
        ({"type": "image_url", "image_url": "https://x/y.png"}, "invalid_messages", f"{PART}.image_url"),
        (
            {"type": "image_url", "image_url": {"url": "x", "size": 2}},
            "invalid_messages",
            f"{PART}.image_url",
        ),
        ({"type": "image_url", "image_url": {"url": 5}}, "invalid_image_url", f"{PART}.image_url"),
        ({"type": "image_url", "image_url": {"url": ""}}, "invalid_image_url", f"{PART}.image_url"),
        (
            {"type": "image_url", "image_url": {"url": "ftp://x/y.png"}},
            "invalid_image_url",
            f"{PART}.image_url",
        ),
        (
            {"type": "image_url", "image_url": {"url": png_url(), "detail": "original"}},
            "invalid_image_url",
            f"{PART}.image_url.detail",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
            "unsupported_parameter",
            f"{PART}.type",
        ),
    ],
)
def test_malformed_chat_image_parts_are_refused_naming_the_part(part, code, param):
    assert _refused(_chat(part))[:2] == (code, param)


def test_images_only_in_user_messages():
    code, param, message = _refused(
        _chat({"type": "image_url", "image_url": {"url": png_url()}}, role="system")
    )
    assert (code, param) == ("unsupported_parameter", f"{PART}.type")
    assert "only user messages may hold images" in message
    part = {"type": "input_image", "image_url": png_url(), "detail": "auto"}
    assert _refused(_responses(part, role="developer"))[:2] == (
        "unsupported_parameter",
        "body.input[0].content[1].type",
    )


RPART = "body.input[0].content[1]"


@pytest.mark.parametrize(
    "part, code, param",
    [
        ({"type": "input_image", "detail": "auto"}, "invalid_input", RPART),
        ({"type": "input_image", "image_url": png_url(), "file_id": "file-a"}, "invalid_input", RPART),
        ({"type": "input_image", "image_url": png_url(), "size": 3}, "invalid_input", f"{RPART}.size"),
        ({"type": "input_image", "file_id": "abc"}, "invalid_input", f"{RPART}.file_id"),
        ({"type": "input_image", "image_url": 7}, "invalid_image_url", f"{RPART}.image_url"),
        ({"type": "input_image", "image_url": "gopher://x"}, "invalid_image_url", f"{RPART}.image_url"),
        (
            {"type": "input_image", "image_url": png_url(), "detail": "max"},
            "invalid_image_url",
            f"{RPART}.detail",
        ),
        ({"type": "input_file", "file_id": "file-a"}, "unsupported_parameter", f"{RPART}.type"),
    ],
)
def test_malformed_input_image_parts_are_refused_naming_the_part(part, code, param):
    assert _refused(_responses(part))[:2] == (code, param)
