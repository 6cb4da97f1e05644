"""Tool-call formats of the 2025-26 model families, read back through their real chat templates
(tests/data/chat_templates, sources in its README): each template names its format, an assistant turn with
tool calls rendered by that template is read back as exactly those calls, and text that is no well-formed
call stays the answer's content."""

from __future__ import annotations

import json
import os

import pytest

from bulkgen.batch.prepare import render_chat
from bulkgen.batch.requests import CHAT, parse_line
from bulkgen.batch.tools import parse_tool_calls, tool_format
from bulkgen.lab.tiny import build_tokenizer
from tests.support.service import HERMES_TEMPLATE, chat_row
from tests.support.tool_formats import TEMPLATES, function_tool

WEATHER = function_tool(
    "get_weather",
    {
        name: {"type": kind, "description": f"a {kind}"}  # Hermes' template writes each description
        for name, kind in [
            ("city", "string"),
            ("days", "integer"),
            ("ratio", "number"),
            ("metric", "boolean"),
            ("where", "object"),
            ("tags", "array"),
        ]
    },
    closed=False,
)
WEATHER["function"]["description"] = "The weather in a city"
NESTED = {"city": "Zürich", "days": 3, "where": {"lat": 47.4, "names": ["Zürich", "東京"]}, "metric": True}
# template file -> (its format, the text that ends the assistant's turn in a rendered conversation (None:
# the tokenizer's end of sequence), whether the template writes an assistant's text beside its calls)
FAMILIES = {
    "Qwen3-Coder.jinja": ("qwen3_coder", "<|im_end|>", True),
    "GLM-4.5.jinja": ("glm45", "<|assistant|>", True),
    "MiniMax-M2.jinja": ("minimax_m2", "[e~[", True),
    "Kimi-K2-Thinking.jinja": ("kimi_k2", "<|im_end|>", True),
    "DeepSeek-V3.jinja": ("deepseek_v3", "<｜end▁of▁sentence｜>", True),
    "DeepSeek-V3.1-tools.jinja": ("deepseek_v31", "<｜end▁of▁sentence｜>", True),
    "Llama-4-pythonic.jinja": ("pythonic", "<|eot|>", True),
    "Hermes.jinja": ("hermes", "<|im_end|>", False),
    "Mistral-Small-3.1.jinja": ("mistral", None, False),
    "Llama-3.1-json.jinja": ("llama3", "<|eot_id|>", False),
}


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text()


def _tokenizer(template: str):
    tok = build_tokenizer()
    tok.chat_template = template
    return tok


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(("name", "expected"), [(n, f[0]) for n, f in FAMILIES.items()])
def test_each_real_template_names_its_format(name, expected):
    assert tool_format(_template(name)) == expected


def test_templates_that_name_no_new_format_keep_theirs():
    assert tool_format(HERMES_TEMPLATE) == "hermes"
    assert (
        tool_format("{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}{% endif %}[TOOL_CALLS]") == "mistral"
    )
    assert tool_format('{% if tools %}<|python_tag|>{"name": .., "parameters": ..}{% endif %}') == "llama3"
    # DeepSeek-V3.1's template as llama.cpp keeps it writes calls but never the tool definitions: refused
    assert tool_format(_template("DeepSeek-V3.1.jinja")) is None


def _rendered_turn(template: str, end: str | None, calls: list[dict], content: str | None) -> str:
    """The assistant's turn as the template writes it: the conversation with that turn, less the prompt
    before it, cut where the turn ends."""
    tok = _tokenizer(template)
    row = chat_row("a", "What is the weather?", tools=[WEATHER])
    prompt = render_chat(parse_line(json.dumps(row), 1, CHAT), tok)
    row["body"]["messages"].append({"role": "assistant", "content": content, "tool_calls": calls})
    full = render_chat(parse_line(json.dumps(row), 1, CHAT), tok)
    start = len(os.path.commonprefix([prompt, full]))  # some prompts end with what the turn replaces
    return full[start : full.index(end or tok.eos_token, start + 1)]


def _api_calls(arguments: list[dict], kimi_ids: bool) -> list[dict]:
    return [
        {
            "id": f"functions.get_weather:{i}" if kimi_ids else f"call_{i:010d}",  # Mistral: 9+ characters
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(a, ensure_ascii=False)},
        }
        for i, a in enumerate(arguments)
    ]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_calls_rendered_by_the_real_template_read_back_exactly(name):
    fmt, end, writes_content = FAMILIES[name]
    # Llama 4's template writes every value quoted (`days="3"`), so only strings survive its round trip
    arguments = (
        [{"city": "Zürich", "days": "3"}, {"city": "Rome"}]
        if fmt == "pythonic"
        else [NESTED, {"city": "Rome"}]
    )
    if fmt == "llama3":  # Llama 3.1's template writes one call a turn
        arguments = arguments[:1]
    calls = _api_calls(arguments, kimi_ids=fmt == "kimi_k2")
    turn = _rendered_turn(_template(name), end, calls, "Let me check." if writes_content else None)
    content, parsed = parse_tool_calls(turn, fmt, [WEATHER])
    assert _calls(parsed) == [("get_weather", a) for a in arguments], turn
    assert all(c["type"] == "function" and c["id"] for c in parsed) and len({c["id"] for c in parsed}) == len(
        arguments
    )
    if fmt == "kimi_k2":  # the id its template writes back when the call is replayed
        assert [c["id"] for c in parsed] == ["functions.get_weather:0", "functions.get_weather:1"]
    if not writes_content:
        assert content is None, turn
        return
    # the text before the calls is kept, and none of their markup: GLM and Kimi open every turn with an
    # empty <think></think> (reasoning is another parser's part), V3.1's own opening differs in spacing
    assert content.endswith("Let me check.") and "get_weather" not in content, turn
    assert content.removeprefix("<think></think>").strip() == "Let me check." or fmt == "deepseek_v31"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_plain_answer_under_each_template_stays_content(name):
    fmt = FAMILIES[name][0]
    for text in ("The weather is fine.", "", "[1, 2, 3]", "Use get_weather(city) later."):
        assert parse_tool_calls(text, fmt, [WEATHER]) == (text, [])


MALFORMED = {
    "qwen3_coder": [
        "<tool_call>\n<function>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n",
    ],
    "glm45": ['<tool_call>{"name": "f"}</tool_call>', "<tool_call>two words\nmore\n</tool_call>"],
    "minimax_m2": ["<minimax:tool_call>\n<invoke>no name</invoke>\n</minimax:tool_call>"],
    "kimi_k2": [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{oops<|tool_call_end|>",
        "<|tool_calls_section_begin|><|tool_call_begin|>no-index<|tool_call_argument_begin|>{}<|tool_call_end|>",
    ],
    "deepseek_v3": [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{bad}\n```<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f {}<｜tool▁call▁end｜>",
    ],
    "deepseek_v31": ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>"],
    "pythonic": [
        '[__import__("os").system("true")]',
        "[f(open('x'))]",
        "[f(x=open('x'))]",
        "[f(**{'a': 1})]",
        "[f(x=1)",
        "[]",
    ],
}


@pytest.mark.parametrize(("fmt", "text"), [(f, t) for f, texts in MALFORMED.items() for t in texts])
def test_a_malformed_call_stays_content(fmt, text):
    assert parse_tool_calls(text, fmt, [WEATHER]) == (text, [])


def test_raw_parameter_values_take_the_type_their_schema_declares():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n007\n</parameter>\n<parameter=days>\n21\n"
        "</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=metric>\nFalse\n</parameter>\n"
        '<parameter=tags>\n["a", "ü"]\n</parameter>\n<parameter=note>\n{"kept": "as text"}\n</parameter>\n'
        "</function>\n</tool_call>"
    )
    _, calls = parse_tool_calls(text, "qwen3_coder", [WEATHER])
    assert _calls(calls) == [
        (
            "get_weather",
            {
                "city": "007",
                "days": 21,
                "ratio": 0.5,
                "metric": False,
                "tags": ["a", "ü"],
                "note": '{"kept": "as text"}',
            },
        )
    ]
    _, calls = parse_tool_calls(text, "qwen3_coder", None)  # no schema: every value as written
    assert json.loads(calls[0]["function"]["arguments"])["days"] == "21"


def test_several_calls_and_multi_line_values():
    text = (
        '<minimax:tool_call>\n<invoke name="write">\n<parameter name="body">line 1\nline 2</parameter>\n'
        '</invoke>\n<invoke name="now">\n</invoke>\n</minimax:tool_call>'
    )
    content, calls = parse_tool_calls(text, "minimax_m2", [])
    assert content is None and _calls(calls) == [("write", {"body": "line 1\nline 2"}), ("now", {})]
    text = '[get_weather(city="Paris"), now(), add(x=1, y=[2, {"z": None}])]'
    _, calls = parse_tool_calls(text, "pythonic", [])
    assert _calls(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
        ("add", {"x": 1, "y": [2, {"z": None}]}),
    ]


def test_a_call_cut_by_max_tokens_is_read_only_when_its_arguments_are_whole():
    whole = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}"
    assert _calls(parse_tool_calls(whole, "kimi_k2")[1]) == [("f", {})]
    cut = whole[:-1] + '{"a": "unfin'
    assert parse_tool_calls(cut, "kimi_k2") == (cut, [])
