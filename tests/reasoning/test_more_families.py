"""GLM-4.5, MiniMax-M2, Kimi K2 Thinking, DeepSeek-R1, and the tool formats of Qwen3-Coder, DeepSeek-V3, V3.1 and
Llama 4 end to end through `bulkgen serve` (the openai client)
and `bulkgen run`: scripted models (bulkgen/lab/scripted.py) write what each family writes under its real chat
template (tests/data/chat_templates), and the reasoning, the answer and a free tool call in the family's syntax
land in their fields. GLM and Kimi write their own `<think>`; MiniMax-M2's and R1's generation prompts open it;
GLM's `enable_thinking: false` closes it in the prompt; Kimi's call markers are special tokens."""

from __future__ import annotations

import json

import pytest

from tests.reasoning.test_special_call_markup import KIMI
from tests.support.reasoning import DEEPSEEK_R1, WEATHER, Case, Family, build_family
from tests.support.service import read_lines, run_bodies, upload, wait_done, write_jsonl

ANSWER = "Blue light scatters most."
GLM = Family(
    "glm45",
    "GLM-4.5.jinja",
    {
        "think": Case("Why is the sky blue?", f"\n<think>Rayleigh scattering.</think>\n{ANSWER}<|user|>"),
        "tool": Case(
            "What is the weather in Paris? " * 3,
            "\n<think>Need the weather tool.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n</tool_call><|observation|>",
            tools=[WEATHER],
        ),
        "no_think": Case(
            "Why is the sky blue? Answer plainly. " * 3,
            f"\n{ANSWER}<|user|>",
            options={"enable_thinking": False},
        ),
    },
)
MINIMAX = Family(
    "minimax_m2",
    "MiniMax-M2.jinja",
    {
        "think": Case("Why is the sky blue?", f"Rayleigh scattering.\n</think>\n\n{ANSWER}[e~["),
        "tool": Case(
            "What is the weather in Paris? " * 3,
            'Need the weather tool.\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
            '<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>[e~[',
            tools=[WEATHER],
        ),
    },
)
QWEN3_CODER = Family(  # Qwen3's tokens, Qwen3-Coder's template: XML calls, no reasoning
    "qwen3",
    "Qwen3-Coder.jinja",
    {
        "tool": Case(
            "What is the weather in Paris?",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>",
            tools=[WEATHER],
        ),
        "plain": Case("Why is the sky blue? " * 8, f"{ANSWER}<|im_end|>"),
    },
)
WEATHER_Q = "What is the weather in Paris?"
DEEPSEEK_V3 = Family(  # vLLM's V3 tool template: `function<｜tool▁sep｜>NAME` and a ```json fence
    "deepseek_v3",
    "DeepSeek-V3.jinja",
    {
        "tool": Case(
            WEATHER_Q,
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
            tools=[WEATHER],
        )
    },
)
DEEPSEEK_V31 = (
    Family(  # V3.1: `NAME<｜tool▁sep｜>{...}`, its generation prompt closing </think> (non-thinking)
        "deepseek_v31",
        "DeepSeek-V3.1-tools.jinja",
        {
            "tool": Case(
                WEATHER_Q,
                '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
                tools=[WEATHER],
            )
        },
    )
)
LLAMA4 = Family(  # vLLM's Llama 4 pythonic template: a list of calls ending the answer
    "llama4",
    "Llama-4-pythonic.jinja",
    {"tool": Case(WEATHER_Q, '[get_weather(city="Paris")]<|eot|>', tools=[WEATHER])},
)
CALLERS = (
    QWEN3_CODER,
    DEEPSEEK_V3,
    DEEPSEEK_V31,
    LLAMA4,
)  # tool formats without reasoning in these templates
FAMILIES = (GLM, MINIMAX, KIMI, DEEPSEEK_R1, *CALLERS)
# through the service, all but Llama 4: its 2,600-token tool prompt needs a model 2,816 wide (a position each),
# slow to serve twice; the service reads calls as `bulkgen run` does, which covers it
SERVED = tuple(f for f in FAMILIES if f is not LLAMA4)
REASONING = (  # each family's scripted reasoning before its answer
    (GLM, "Rayleigh scattering."),
    (MINIMAX, "Rayleigh scattering."),
    (KIMI, "Rayleigh."),
    (DEEPSEEK_R1, "The user asks about the sky.\nRayleigh scattering."),
)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f.model: build_family(root, f) for f in FAMILIES}


def _rows(family: Family) -> list[dict]:  # one model per file
    url = "/v1/chat/completions"
    return [
        {"custom_id": f"{family.name}-{case}", "method": "POST", "url": url, "body": family.body(case)}
        for case in family.cases
    ]


def _check(bodies: dict[str, dict], callers=CALLERS) -> None:
    for family, reasoning in REASONING:
        think = bodies[f"{family.name}-{'plain' if family is KIMI else 'think'}"]
        message = think["choices"][0]["message"]
        assert (message["content"], message["reasoning"]) == (ANSWER, reasoning), family.name
        assert think["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
        if "tool" not in family.cases and "call" not in family.cases:
            continue  # R1's own template renders no tools
        tool = bodies[f"{family.name}-{'call' if family is KIMI else 'tool'}"]["choices"][0]
        assert tool["finish_reason"] == "tool_calls", (family.name, tool)
        assert (tool["message"]["content"], tool["message"]["reasoning"]) == (None, "Need the weather tool.")
        (call,) = tool["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert (call["id"] == "functions.get_weather:0") is (family is KIMI)  # Kimi's own id, kept
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    for family in callers:
        choice = bodies[f"{family.name}-tool"]["choices"][0]
        assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", None), family.name
        (call,) = choice["message"]["tool_calls"]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
            "get_weather",
            {"city": "Paris"},
        )
    assert bodies["qwen3-plain"]["choices"][0]["message"]["content"] == ANSWER
    plain = bodies["glm45-no_think"]["choices"][0]["message"]
    assert (plain["content"], plain["reasoning"]) == (ANSWER, None)


@pytest.mark.slow
def test_families_through_bulkgen_run(tmp_path, paths):
    bodies = {}
    for family in FAMILIES:
        model = ("--model", f"{family.model}={paths[family.model]}")
        bodies |= run_bodies(tmp_path, family.name, _rows(family), *model)
    _check(bodies)


def test_families_through_the_service(service, client, paths, monkeypatch, tmp_path):
    for name, path in paths.items():
        monkeypatch.setitem(service.svc.settings.models, name, str(path))
    batches = []
    for family in SERVED:  # submitted together, one model per batch
        path = write_jsonl(tmp_path / f"{family.name}.jsonl", _rows(family))
        batches.append(
            client.batches.create(
                input_file_id=upload(client, path).id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
            )
        )
    bodies = {}
    for batch in batches:
        batch = wait_done(client, batch.id, timeout=300)
        assert batch.status == "completed" and batch.request_counts.failed == 0, batch
        lines = {
            line["custom_id"]: line["response"]["body"] for line in read_lines(client, batch.output_file_id)
        }
        assert batch.usage.output_tokens_details.reasoning_tokens == sum(
            b["usage"]["completion_tokens_details"]["reasoning_tokens"] for b in lines.values()
        )
        bodies |= lines
    _check(bodies, tuple(f for f in CALLERS if f in SERVED))
