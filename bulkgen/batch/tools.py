"""Tool calls in a model's output -> the API's `message.tool_calls`, for the formats chat templates define.

- hermes:  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2/2.5/3, many others)
- llama3:  `{"name": ..., "parameters": {...}}` as the whole answer, optionally after `<|python_tag|>`
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
- harmony: gpt-oss's `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`, whose
  markers are special tokens: read from the token ids with its reasoning (bulkgen.batch.reasoning), not here

The format is read from the chat template's source (`tool_format`): the template is what taught the model
how to call, so it is also how to read the call back. Text that does not parse as a call stays content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from bulkgen.batch.ids import random_id

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def tool_format(template: str | None) -> str | None:
    """The call format a chat template teaches; None when it does not render tools at all."""
    if not template or "tools" not in template:
        return None
    if "<|channel|>" in template:
        return "harmony"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template or "[AVAILABLE_TOOLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters"' in template or "<|eom_id|>" in template:
        return "llama3"
    return "hermes"  # a template that renders tools without naming a format: the most common one


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict[str, Any]]]:
    """-> (content before the calls, or None when there is none; the calls in the API's shape).
    No call found: (text, [])."""
    if fmt == "harmony":  # its calls are read from the token ids (call_of)
        return text, []
    if fmt == "hermes":
        calls = [_call(m) for m in _HERMES.findall(text)]
        before = text.split("<tool_call>", 1)[0]
    elif fmt == "mistral":
        before, _, rest = text.partition("[TOOL_CALLS]")
        calls = _json_calls(rest) if _ else []
    else:
        before, _, rest = text.rpartition("<|python_tag|>")
        calls = _json_calls(rest.strip())
        before = before if _ else ""
    if not calls or any(c is None for c in calls):
        return text, []
    return (before.strip() or None), calls


def _json_calls(text: str) -> list[dict | None]:
    """One call object, a list of them, or several separated by ';' (Llama 3.2's habit)."""
    try:
        value = json.loads(text)
    except ValueError:
        parts = [p for p in text.split(";") if p.strip()]
        return [_call(p) for p in parts] if len(parts) > 1 else []
    return [_call(v) for v in value] if isinstance(value, list) else [_call(value)]


def _call(raw: str | Any) -> dict[str, Any] | None:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        return None
    arguments = raw.get("arguments", raw.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": random_id("call_"),
        "type": "function",
        "function": {"name": raw["name"], "arguments": arguments},
    }


def call_of(name: str, arguments: str) -> dict[str, Any]:
    """A call read from a format's own structure (harmony's channels, bulkgen.batch.reasoning) in the API's
    shape."""
    return _call({"name": name, "arguments": arguments})
