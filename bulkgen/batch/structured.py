"""Structured outputs of a chat body: `response_format` and forced tool calls -> an engine grammar (Guide).

- `response_format: {"type": "json_object"}`: any JSON object. `{"type": "json_schema", "json_schema":
  {"name", "schema", "strict", "description"}}`: a document of that schema (strict or not: the engine
  always enforces the schema). A schema the grammar compiler cannot take (refused, too large, too slow,
  admitting no document: bulkgen.engine.features.schema_compiler) is this line's 400 naming `body.response_format`,
  found at validation (compiled once per distinct schema, then cached); one whose grammar fails only while
  decoding is the same 400 at run time (`ParsedRequest.guide_param` names the field). The Responses API's
  `text.format` takes the same format object, flat (`json_schema_guide`, from bulkgen.batch.endpoints.responses).
- `tool_choice: "required"`: the output is one call of one of the request's tools, `{"name": ...,
  "arguments": {...}}` with the arguments valid for that function's `parameters`; a named function
  (`tool_choice: {"type": "function", "function": {"name"}}`, or the legacy `function_call: {"name"}`):
  the output is that function's arguments. The answer carries them as `message.tool_calls` (ids
  `call_...`), `content: null`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from bulkgen.batch.bodyfields import LineError, invalid
from bulkgen.batch.ids import random_id
from bulkgen.batch.schema import quote
from bulkgen.engine.features.guide import GrammarError, Guide, check

REQUIRED = "*"  # forced_tool of tool_choice "required": any of the tools
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
ANY_ARGUMENTS = {"type": "object"}


def response_guide(body: dict) -> Guide | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return Guide.json_object()
    if kind != "json_schema" or set(fmt) != {"type", "json_schema"}:
        raise invalid(
            "response_format",
            "must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
            "'json_schema', 'json_schema': {...}}",
            fmt,
        )
    return json_schema_guide(fmt["json_schema"], "response_format.json_schema", "response_format")


def json_schema_guide(fmt: Any, param: str, compiled_as: str) -> Guide:
    """A json_schema format's `{"name", "schema", "strict", "description"}` (chat's
    `response_format.json_schema`, the Responses API's `text.format`) -> its checked grammar. `param` names
    the format in errors; a schema the compiler cannot take is refused naming `body.<compiled_as>`."""
    if not isinstance(fmt, dict) or not set(fmt) <= _JSON_SCHEMA_KEYS:
        raise invalid(param, f"must be an object with keys from {sorted(_JSON_SCHEMA_KEYS)}", fmt)
    if not isinstance(fmt.get("name"), str) or not _NAME.match(fmt["name"]):
        raise invalid(f"{param}.name", "must be 1-64 letters, digits, '_' or '-'", fmt.get("name"))
    schema = fmt.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid(f"{param}.schema", "must be a JSON schema object", schema)
    for key, kind in (("strict", bool), ("description", str)):
        if fmt.get(key) is not None and not isinstance(fmt[key], kind):
            raise invalid(f"{param}.{key}", f"must be a {kind.__name__} (or null)", fmt[key])
    return _compiled(Guide.json_schema(schema), compiled_as)


def forced_tool(body: dict, tools: list[dict] | None) -> tuple[str | None, Guide | None]:
    """(REQUIRED or the forced function's name, the grammar of its output), or (None, None) when the
    model is free to call or not."""
    param = forced_param(body)
    choice = body.get(param)
    if param == "function_call":
        choice = {"type": "function", "function": choice}
    if choice == "required":
        if not tools:
            raise invalid("tool_choice", "is 'required' but the request has no tools", choice)
        calls = [_call_schema(t["function"]) for t in tools]
        return REQUIRED, _compiled(
            Guide.json_schema(calls[0] if len(calls) == 1 else {"anyOf": calls}), param
        )
    if not (isinstance(choice, dict) and choice.get("type") == "function"):
        return None, None
    name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
    match = [t["function"] for t in tools or () if t["function"]["name"] == name]
    if not match:
        raise invalid(param, f"names function {quote(name)}, which is not among the request's tools", choice)
    return name, _compiled(Guide.json_schema(match[0].get("parameters") or ANY_ARGUMENTS), param)


def forced_param(body: dict) -> str:
    """The field that forces a call: `tool_choice`, or the legacy `function_call: {"name"}` without it."""
    if body.get("tool_choice") is None and isinstance(body.get("function_call"), dict):
        return "function_call"
    return "tool_choice"


def _call_schema(function: dict) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": function.get("parameters") or ANY_ARGUMENTS,
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _compiled(guide: Guide, param: str) -> Guide:
    try:
        check(guide)
    except GrammarError as exc:
        raise LineError(
            "invalid_parameter",
            f"body.{param}: the schema cannot be used for constrained decoding: {exc}",
            f"body.{param}",
        ) from None
    return guide


def forced_calls(text: str, forced: str) -> list[dict[str, Any]] | None:
    """The tool call(s) a forced output holds, in the API's shape; None if the text is not a whole
    document (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    name, arguments = (value.get("name"), value.get("arguments")) if forced == REQUIRED else (forced, value)
    if not isinstance(name, str):
        return None
    return [
        {
            "id": random_id("call_"),
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }
    ]
