"""Readers of the tool-call formats that are not a JSON call object (bulkgen.batch.tools picks one per chat
template and shapes what it reads into the API's `tool_calls`).

Each reader takes the model's text and the request's tool schemas (`params`: function name -> its
`parameters`) and returns (the text before the calls, [(name, arguments, call id or None)]); bulkgen.batch.tools
keeps the whole text as the answer's content when there is no call, or when the reader returned None, a
None call or None arguments (a malformed call). Formats whose
parameter values are raw text (Qwen3-Coder, GLM, MiniMax) are typed by the schema the tool declares, as
vLLM's parsers do: a parameter declared `integer` written `21` becomes 21, a `string` stays as written.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

Call = tuple[str, Any, str | None]  # (function name, arguments: an object or its JSON text, call id)
Parsed = tuple[str, list[Call | None]] | None  # a None call (or arguments): malformed

_QWEN_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
_GLM_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.DOTALL)
_MINIMAX_BLOCK = re.compile(r"<minimax:tool_call>(.*?)(?:</minimax:tool_call>|$)", re.DOTALL)
_MINIMAX_INVOKE = re.compile(r'<invoke name="([^"]+)">(.*?)(?:</invoke>|$)', re.DOTALL)
_MINIMAX_PARAMETER = re.compile(r'<parameter name="([^"]+)">(.*?)(?:</parameter>|$)', re.DOTALL)
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>\s*(.*?)\s*(?:<\|tool_call_end\|>|$)",
    re.DOTALL,
)
_KIMI_ID = re.compile(r"^(?:functions\.)?(.+?):\d+$")
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.DOTALL)
_PY_LIST = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_]*\(")
_DS_V3_BODY = re.compile(r"^([^\n]+)\n```(?:json)?\n(.*?)\n?```\s*$", re.DOTALL)


def qwen3_coder(text: str, params: dict[str, dict]) -> Parsed:
    """`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`."""
    calls = []
    for name, body in _QWEN_FUNCTION.findall(text):
        schema = params.get(name.strip(), {})
        values = {k.strip(): _trim_newline(v) for k, v in _QWEN_PARAMETER.findall(body)}
        calls.append((name.strip(), _typed_all(values, schema), None))
    return _before(text, ("<tool_call>", "<function="), calls)


def glm45(text: str, params: dict[str, dict]) -> Parsed:
    """`<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>`."""
    calls = []
    for body in _GLM_CALL.findall(text):
        name = body.split("<arg_key>", 1)[0].strip()
        if not name or "\n" in name or "{" in name:  # a JSON call (hermes) or prose is no GLM call
            return None
        values = {k.strip(): v.strip() for k, v in _GLM_ARG.findall(body)}
        calls.append((name, _typed_all(values, params.get(name, {})), None))
    return _before(text, ("<tool_call>",), calls)


def minimax_m2(text: str, params: dict[str, dict]) -> Parsed:
    """`<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter></invoke>...`."""
    calls = []
    for block in _MINIMAX_BLOCK.findall(text):
        for name, body in _MINIMAX_INVOKE.findall(block):
            values = {k: v.strip() for k, v in _MINIMAX_PARAMETER.findall(body)}
            calls.append((name, _typed_all(values, params.get(name, {})), None))
    return _before(text, ("<minimax:tool_call>",), calls)


def kimi_k2(text: str, params: dict[str, dict]) -> Parsed:
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}
    <|tool_call_end|><|tool_calls_section_end|>`. The id `functions.NAME:IDX` is kept as the call's id:
    Kimi's template writes a replayed call's id back in that place."""
    calls = []
    for call_id, arguments in _KIMI_CALL.findall(text):
        match = _KIMI_ID.match(call_id)
        if match is None:
            return None
        calls.append((match.group(1), _json_object(arguments), call_id))
    return _before(text, ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"), calls)


def deepseek_v3(text: str, params: dict[str, dict]) -> Parsed:
    """DeepSeek-V3 and R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json
    \\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`."""
    calls = []
    for kind, body in _DS_CALL.findall(text):
        match = _DS_V3_BODY.match(body.strip("\n"))
        if kind.strip() != "function" or match is None:
            return None
        calls.append((match.group(1).strip(), _json_object(match.group(2)), None))
    return _before(text, ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"), calls)


def deepseek_v31(text: str, params: dict[str, dict]) -> Parsed:
    """DeepSeek-V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""
    calls = [(name.strip(), _json_object(body), None) for name, body in _DS_CALL.findall(text)]
    return _before(text, ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>"), calls)


def pythonic(text: str, params: dict[str, dict]) -> Parsed:
    """Llama 4 (and Llama 3.2's pythonic template): `[get_weather(city="Paris"), now()]` ending the answer,
    optionally inside `<|python_start|>...<|python_end|>`. Read with `ast`, never evaluated: only calls of
    plain names with keyword arguments of literal values are calls."""
    source = text.rstrip().removesuffix("<|python_end|>").rstrip()
    start = _PY_LIST.search(source)
    if start is None or not source.endswith("]"):
        return None
    try:  # the first `[name(` opens the calls: one parse, whatever the text's length
        tree = ast.parse(source[start.start() :], mode="eval").body
        if not isinstance(tree, ast.List):
            return None
        calls = [_python_call(node) for node in tree.elts]
    except (SyntaxError, ValueError, RecursionError):
        return None
    return source[: start.start()].removesuffix("<|python_start|>"), calls


def _python_call(node: ast.expr) -> Call:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call of a named function with keyword arguments")
    if any(k.arg is None for k in node.keywords):
        raise ValueError("**kwargs")
    return node.func.id, {k.arg: ast.literal_eval(k.value) for k in node.keywords}, None


def _before(text: str, openers: tuple[str, ...], calls: list[Call | None]) -> Parsed:
    """(the text before the first opener, the calls); bulkgen.batch.tools refuses an empty or malformed list."""
    cut = min((i for i in (text.find(o) for o in openers) if i >= 0), default=len(text))
    return text[:cut], calls


def _json_object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _trim_newline(value: str) -> str:
    """Qwen3-Coder's template writes `\\n` on each side of a value; the value itself is what lies between."""
    return value.removeprefix("\n").removesuffix("\n")


def _typed_all(values: dict[str, str], schema: dict) -> dict[str, Any]:
    properties = schema.get("properties") if isinstance(schema, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    return {k: _typed(v, properties.get(k)) for k, v in values.items()}


def _typed(raw: str, schema: Any) -> Any:
    """A raw parameter value as the JSON type its schema declares; a string, or a value whose type is not
    declared, stays the text as written (what the model wrote is not second-guessed)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = {kinds} if isinstance(kinds, str) else set(kinds or ())
    if not kinds or "string" in kinds:
        return raw
    if "boolean" in kinds and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    try:
        return json.loads(raw)
    except ValueError:
        return raw
