"""Tool calls in a model's output -> the API's `message.tool_calls`, for the formats chat templates define.

- hermes:  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen 2/2.5/3, many others)
- llama3:  `{"name": ..., "parameters": {...}}` as the whole answer, optionally after `<|python_tag|>`
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
- qwen3_coder, glm45, minimax_m2, kimi_k2, deepseek_v3, deepseek_v31, pythonic: bulkgen.batch.tool_markup
- harmony: gpt-oss's `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`, whose
  markers are special tokens: read from the token ids with its reasoning (bulkgen.batch.reasoning), not here

The format is read from the chat template's source (`tool_format`): the template is what taught the model
how to call, so it is also how to read the call back. FORMATS is the table: each format's name, the marks
of its template and its reader, tried in order (the first whose marks the template holds). Text that does
not parse as a call stays content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bulkgen.batch import forced_syntax, tool_markup
from bulkgen.batch.ids import random_id
from bulkgen.batch.structured import REQUIRED
from bulkgen.batch.tool_markup import Call, Parsed
from bulkgen.engine.features.guide import Guide

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str, params: dict[str, dict]) -> Parsed:
    return text.split("<tool_call>", 1)[0], [_json_call(m) for m in _HERMES.findall(text)]


def _mistral(text: str, params: dict[str, dict]) -> Parsed:
    before, found, rest = text.partition("[TOOL_CALLS]")
    return before, _json_calls(rest) if found else []


def _harmony(text: str, params: dict[str, dict]) -> Parsed:
    """None: its calls are read from the token ids, with its channels (bulkgen.batch.reasoning)."""
    return None


def _llama3(text: str, params: dict[str, dict]) -> Parsed:
    before, found, rest = text.rpartition("<|python_tag|>")
    return (before if found else ""), _json_calls(rest.strip())


@dataclass(frozen=True)
class ToolFormat:
    """A call syntax: the strings that mark a template teaching it (all of them present), its reader, and
    the writer of a forced call in it (bulkgen.batch.forced_syntax; None: forced as a JSON document)."""

    name: str
    marks: tuple[str, ...]
    read: Callable[[str, dict[str, dict]], Parsed]
    force: forced_syntax.Writer | None = None


# Most specific first: Qwen3-Coder and GLM also write `<tool_call>`, DeepSeek-V3 and V3.1 share their
# tokens (V3 adds a ```json fence), a pythonic Llama template may hold the JSON ones' marks as well. A
# format several sets of marks point at has a row for each.
FORMATS = (
    ToolFormat("harmony", ("<|channel|>",), _harmony),
    ToolFormat(
        "qwen3_coder", ("<function=", "<parameter="), tool_markup.qwen3_coder, forced_syntax.qwen3_coder
    ),
    ToolFormat("glm45", ("<arg_key>",), tool_markup.glm45, forced_syntax.glm45),
    ToolFormat(
        "minimax_m2",
        ("<minimax:tool_call>", "<invoke name="),
        tool_markup.minimax_m2,
        forced_syntax.minimax_m2,
    ),
    ToolFormat("kimi_k2", ("<|tool_call_begin|>",), tool_markup.kimi_k2, forced_syntax.kimi_k2),
    ToolFormat(
        "deepseek_v3",
        ("<｜tool▁call▁begin｜>", "```json"),
        tool_markup.deepseek_v3,
        forced_syntax.deepseek_v3,
    ),
    ToolFormat(
        "deepseek_v31", ("<｜tool▁call▁begin｜>",), tool_markup.deepseek_v31, forced_syntax.deepseek_v31
    ),
    ToolFormat("hermes", ("<tool_call>",), _hermes),
    ToolFormat("mistral", ("[TOOL_CALLS]",), _mistral),
    ToolFormat("mistral", ("[AVAILABLE_TOOLS]",), _mistral),
    ToolFormat("pythonic", ("func_name1(",), tool_markup.pythonic, forced_syntax.pythonic),
    ToolFormat("llama3", ("<|python_tag|>",), _llama3),
    ToolFormat("llama3", ('"parameters"',), _llama3),
    ToolFormat("llama3", ("<|eom_id|>",), _llama3),
)
NONE = "none"  # --tool-parser none: calls are not read, they stay content
READERS = {f.name: f.read for f in FORMATS} | {NONE: lambda text, params: None}
WRITERS = {f.name: f.force for f in FORMATS if f.force is not None}


def tool_format(template: str | None) -> str | None:
    """The call format a chat template teaches; None when it does not render tools at all."""
    if not template or "tools" not in template:
        return None
    for fmt in FORMATS:
        if all(mark in template for mark in fmt.marks):
            return fmt.name
    return "hermes"  # a template that renders tools without naming a format: the most common one


def forced_guide(fmt: str, forced: str, tools: list[dict], special: set[str]) -> Guide | None:
    """The grammar of a forced call (`forced`: REQUIRED or the function's name) in the format's own syntax;
    None where the format has no writer, or its markup holds a token the tokenizer keeps as special (the
    grammar spells text, and decoding drops special tokens): the call is then forced as a JSON document."""
    write = WRITERS.get(fmt)
    if write is None:
        return None
    grammar = forced_syntax.forced_grammar(write, forced, tools, forced == REQUIRED)
    if any(token in text for text in forced_syntax.literals(grammar) for token in special):
        return None
    return Guide.lark(grammar)


def parse_tool_calls(
    text: str, fmt: str, tools: list[dict] | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """-> (content before the calls, or None when there is none; the calls in the API's shape).
    No call found, or one malformed: (text, []). `tools`: the request's tools, whose parameter schemas
    type the raw values of the formats that write them as text."""
    params = _parameters(tools)
    parsed = READERS[fmt](text, params)
    if parsed is None:
        return text, []
    before, calls = parsed
    if not calls or any(c is None or c[1] is None for c in calls):
        return text, []
    return (before.strip() or None), [call_of(*c) for c in calls]


_DEEPSEEK_MARKUP = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)
# The tokens each format writes its calls with. Where a tokenizer has them as special tokens (Kimi K2's,
# Mistral's tekken, DeepSeek's where marked so), decoding that skips special tokens erases them and the call
# can no longer be read (vLLM's parsers turn `skip_special_tokens` off for such requests): a line that
# offers tools has its output decoded again with these kept (bulkgen.batch.special_tokens).
MARKUP = {
    "kimi_k2": (
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ),
    "deepseek_v3": _DEEPSEEK_MARKUP,
    "deepseek_v31": _DEEPSEEK_MARKUP,
    "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    "llama3": ("<|python_tag|>",),
    "pythonic": ("<|python_start|>", "<|python_end|>"),
    "hermes": ("<tool_call>", "</tool_call>"),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "glm45": ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "minimax_m2": ("<minimax:tool_call>", "</minimax:tool_call>"),
}


def call_markup(fmt: str | None) -> tuple[str, ...]:
    return MARKUP.get(fmt, ()) if fmt else ()


def malformed_call(text: str, fmt: str, tools: list[dict] | None = None) -> bool:
    """Whether `text` holds a call in format `fmt` that its reader found and could not read (what
    parse_tool_calls then leaves as content): output health's `tool_call_unparsed`."""
    params = _parameters(tools)
    parsed = READERS[fmt](text, params) if fmt in READERS else None
    if parsed is None:  # harmony: its calls are read from the token ids
        return False
    calls, start = parsed[1], call_markup(fmt)[:1]  # the token a call opens with
    return any(c is None or c[1] is None for c in calls) or (not calls and any(m in text for m in start))


def _parameters(tools: list[dict] | None) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools or ()}


def call_of(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """A call in the API's shape: `arguments` as JSON text, the model's own id or a new `call_...`."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": call_id or random_id("call_"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _json_calls(text: str) -> list[Call | None]:
    """One call object, a list of them, or several separated by ';' (Llama 3.2's habit)."""
    try:
        value = json.loads(text)
    except ValueError:
        parts = [p for p in text.split(";") if p.strip()]
        return [_json_call(p) for p in parts] if len(parts) > 1 else []
    return [_json_call(v) for v in value] if isinstance(value, list) else [_json_call(value)]


def _json_call(raw: str | Any) -> Call | None:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        return None
    return raw["name"], raw.get("arguments", raw.get("parameters", {})), None
