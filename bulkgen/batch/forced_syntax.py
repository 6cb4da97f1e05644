"""A forced tool call (`tool_choice` required or named) written in the model's own call syntax: the lark
grammar (llguidance) of one call of the forced function, or of any of the request's tools, in the format
its chat template teaches (bulkgen.batch.tools.FORMATS names each format's writer here).

Why: a model calls best in the syntax it was trained on; the JSON document bulkgen.batch.structured forces
otherwise is foreign to it. Arguments written as JSON are constrained by the function's `parameters`
schema (llguidance's `%json`, compact separators as everywhere else); formats that write each parameter
as raw text (Qwen3-Coder, GLM, MiniMax) or as Python keywords (pythonic) get one item per declared
property, in the schema's order, the required ones always and the others optional; a string is raw text
without `<` (at most `maxLength` characters; or one of its `enum`), any other type its JSON. The output is read back by the same format's
reader, so a forced call lands in `tool_calls` exactly as a free one does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

ANY_ARGUMENTS = {"type": "object"}
_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
RAW_TEXT = "/[^<]*/"

# A writer: (the function's name, its parameters schema, a prefix for rule names) -> (the expression of one
# call, the rules it uses).
Writer = Callable[[str, dict, str], tuple[str, list[str]]]


def forced_grammar(write: Writer, forced: str | None, tools: list[dict], any_tool: bool) -> str:
    """The lark grammar of one call: of the function named `forced`, or (`any_tool`) of any of `tools`."""
    functions = [t["function"] for t in tools if any_tool or t["function"]["name"] == forced]
    rules, calls = [], []
    for i, function in enumerate(functions):
        call, used = write(function["name"], function.get("parameters") or ANY_ARGUMENTS, f"f{i}_")
        calls.append(call)
        rules += used
    return "\n".join([f"start: {' | '.join(calls)}", *rules]) + "\n"


def literals(grammar: str) -> list[str]:
    """The quoted strings of a grammar this module wrote (to find markup a tokenizer holds as special)."""
    found, i = [], grammar.find('"')
    while i >= 0:
        value, end = json.JSONDecoder().raw_decode(grammar, i)
        found.append(value)
        i = grammar.find('"', end)
    return found


def _q(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json_rule(name: str, schema: Any) -> str:
    schema = dict(schema) if isinstance(schema, dict) else {}
    schema["x-guidance"] = _JSON_OPTIONS
    return f"{name}: %json {json.dumps(schema, ensure_ascii=False)}"


def _json_arguments(prefix: str, suffix: str) -> Writer:
    """Formats whose arguments are one JSON object between fixed text (`{name}` in it: the function)."""

    def write(name: str, schema: dict, rule: str) -> tuple[str, list[str]]:
        args = f"{rule}args"
        return f"{_q(prefix.format(name=name))} {args} {_q(suffix.format(name=name))}", [
            _json_rule(args, schema)
        ]

    return write


deepseek_v3 = _json_arguments(
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
    "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
)
deepseek_v31 = _json_arguments(
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{name}<｜tool▁sep｜>",
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
)
kimi_k2 = _json_arguments(
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>",
    "<|tool_call_end|><|tool_calls_section_end|>",
)


def _raw_value(name: str, schema: Any) -> tuple[str, list[str]]:
    """A parameter written as raw text: (its expression, its rules)."""
    schema = schema if isinstance(schema, dict) else {}
    kinds = schema.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds or ())
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(_q(v) for v in schema["enum"]) + ")", []
    if not kinds or "string" in kinds:
        bound = schema.get("maxLength")
        return (f"/[^<]{{0,{bound}}}/" if isinstance(bound, int) and bound >= 0 else RAW_TEXT), []
    if kinds == {"boolean"}:
        return '("true" | "false")', []
    return name, [_json_rule(name, schema)]


def _raw_parameters(head: str, item: str, tail: str) -> Writer:
    """Formats that write each parameter as `item` ({key}, {value}) between `head` and `tail` ({name})."""

    def write(name: str, schema: dict, rule: str) -> tuple[str, list[str]]:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = set(schema.get("required") or ())
        parts, rules = [_q(head.format(name=name))], []
        for i, (key, prop) in enumerate(properties.items()):
            value, used = _raw_value(f"{rule}v{i}", prop)
            before, after = item.split("{value}")
            expression = f"{_q(before.format(key=key))} {value} {_q(after)}"
            parts.append(f"({expression})" + ("" if key in required else "?"))
            rules += used
        parts.append(_q(tail))
        return " ".join(parts), rules

    return write


qwen3_coder = _raw_parameters(
    "<tool_call>\n<function={name}>\n",
    "<parameter={key}>\n{value}\n</parameter>\n",
    "</function>\n</tool_call>",
)
glm45 = _raw_parameters(
    "<tool_call>{name}\n", "<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n", "</tool_call>"
)
minimax_m2 = _raw_parameters(
    '<minimax:tool_call>\n<invoke name="{name}">\n',
    '<parameter name="{key}">{value}</parameter>\n',
    "</invoke>\n</minimax:tool_call>",
)


def pythonic(name: str, schema: dict, rule: str) -> tuple[str, list[str]]:
    """`[NAME(key=value, ...)]`: values as Python literals (JSON's, but True/False for booleans)."""
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or ())
    items, rules = [], []
    for i, (key, prop) in enumerate(properties.items()):
        kinds = prop.get("type") if isinstance(prop, dict) else None
        if kinds == "boolean":
            value = '("True" | "False")'
        else:
            value = f"{rule}v{i}"
            rules.append(_json_rule(value, prop))
        items.append((f"{_q(key + '=')} {value}", key in required))
    first, more = _separated(items, rule)
    return f"{_q('[' + name + '(')} {first} {_q(')]')}", rules + more


def _separated(items: list[tuple[str, bool]], rule: str) -> tuple[str, list[str]]:
    """The items in order joined by ", ", each optional unless required: `first_i` is the list from item
    i on when none was written yet, `rest_i` when one was (so a separator comes before the next)."""
    rules, first, rest = [], '""', '""'
    for i in range(len(items) - 1, -1, -1):
        item, required = items[i]
        rules.append(f'{rule}rest{i}: {"" if required else "("}", " {item}{"" if required else ")?"} {rest}')
        choice = f"{item} {rest}" if required else f"{item} {rest} | {first}"
        rules.append(f"{rule}first{i}: {choice}")
        first, rest = f"{rule}first{i}", f"{rule}rest{i}"
    return first, rules
