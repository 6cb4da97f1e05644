"""What is wrong with an answer that ran: the problems bulkgen.metrics.health counts per batch.

Read from the answer body bulkgen writes (chat completion, text completion, Response) and the request it
answers, per line (a line with several choices has a problem when any choice has it):
- empty_answer: a choice with no content (blank), no tool call and no reasoning;
- reasoning_without_answer: a choice with reasoning and no answer (typically `max_tokens` spent thinking);
- schema_failed: the line asked for JSON (`response_format` json_object / json_schema, the Responses API's
  `text.format`) and a choice's content does not parse, or does not validate against the schema (constrained
  decoding makes this rare: it is what a `max_tokens` cut leaves);
- tool_call_unparsed: the line offered tools and a choice's content holds a call in the template's format
  that did not parse (the reader bulkgen.batch.tools uses found the call's marks and no valid call).
Embeddings answers have no text: they count as answers, with no finish reason and no problem.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jsonschema

from bulkgen.batch.requests import ParsedRequest
from bulkgen.batch.tools import malformed_call
from bulkgen.metrics.health import OutputHealth


def observe(health: OutputHealth, request: ParsedRequest, body: dict[str, Any]) -> None:
    """Count one answered line's body in `health`."""
    reasons, problems = line_problems(request, body)
    health.add(request.custom_id, reasons, problems)


def line_problems(request: ParsedRequest, body: dict[str, Any]) -> tuple[list[str | None], set[str]]:
    """(each choice's finish reason, the line's problems) of a 200 answer body."""
    kind = body.get("object")
    if kind == "response":
        cut = body.get("status") == "incomplete"
        choices = [_response_choice(body)]
        reasons: list[str | None] = ["length" if cut else "stop"]
    elif kind in ("chat.completion", "text_completion"):
        choices = [_choice(c) for c in body.get("choices") or ()]
        reasons = [c.get("finish_reason") for c in body.get("choices") or ()]
    else:  # embeddings: vectors, nothing to judge
        return [], set()
    problems = set()
    schema = _json_schema(request)
    for content, reasoning, calls in choices:
        answered = bool(calls) or bool(content and content.strip())
        if not answered:
            problems.add("reasoning_without_answer" if reasoning and reasoning.strip() else "empty_answer")
        if schema is not None and not calls and content is not None and not _valid(content, schema):
            problems.add("schema_failed")
        if request.tools and request.tool_format and not calls and content:
            if malformed_call(content, request.tool_format, request.tools):
                problems.add("tool_call_unparsed")
    return reasons, problems


def _choice(choice: dict) -> tuple[str | None, str | None, list]:
    """(content, reasoning, tool calls) of a chat or text completion choice."""
    if "message" not in choice:
        return choice.get("text"), None, []
    message = choice["message"]
    calls = list(message.get("tool_calls") or ())
    calls += [message["function_call"]] if message.get("function_call") else []
    return message.get("content"), message.get("reasoning"), calls


def _response_choice(body: dict) -> tuple[str | None, str | None, list]:
    texts, reasoning, calls = [], [], []
    for item in body.get("output") or ():
        if item.get("type") == "message":
            texts += [
                p.get("text") or "" for p in item.get("content") or () if p.get("type") == "output_text"
            ]
        elif item.get("type") == "reasoning":
            reasoning += [p.get("text") or "" for p in item.get("content") or ()]
        elif item.get("type") == "function_call":
            calls.append(item)
    return ("".join(texts) if texts else None), ("".join(reasoning) or None), calls


def _json_schema(request: ParsedRequest) -> str | None:
    """The line's JSON constraint as schema text ("{}"-like for json_object); None when it asks for none or
    the constraint is a forced tool call (its answer is tool_calls, checked by their parse)."""
    guide = request.sampling.get("guide")
    if guide is None or request.forced_tool is not None:
        return None
    if guide.kind == "json_object":
        return '{"type":"object"}'
    return guide.schema if guide.kind == "json_schema" else None


def _valid(content: str, schema: str) -> bool:
    try:
        document = json.loads(content)
    except ValueError:
        return False
    try:
        return _validator(schema).is_valid(document)
    except jsonschema.exceptions.JsonSchemaException:  # a schema the validator cannot read: not judged
        return True


@lru_cache(maxsize=256)
def _validator(schema: str):
    parsed = json.loads(schema)
    cls = jsonschema.validators.validator_for(parsed)
    return cls(parsed, format_checker=None)
