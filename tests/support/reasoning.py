"""Reasoning families for tests: each family's real chat template (tests/data/chat_templates), the questions the
tests ask, and the exact text its scripted model (bulkgen/lab/scripted.py) writes after each.

A script is keyed by the length of its question's prompt as the family's template renders it, so each case's
question (and template options) gives its prompt a length of its own; `build_family` checks that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bulkgen.lab.scripted import FAMILIES, build_family_tokenizer, build_scripted_model

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@dataclass(frozen=True)
class Case:
    question: str
    script: str  # what the model writes, its end-of-turn marker included
    options: dict = field(default_factory=dict)  # chat_template_kwargs
    tools: list | None = None


@dataclass(frozen=True)
class Family:
    name: str  # bulkgen.lab.scripted.FAMILIES key
    template: str  # file under TEMPLATES
    cases: dict[str, Case]

    @property
    def model(self) -> str:
        return f"scripted-{self.name}"

    def tokenizer(self):
        return build_family_tokenizer(FAMILIES[self.name], (TEMPLATES / self.template).read_text())

    def prompt(self, case: Case) -> str:
        extra = {"tools": case.tools} if case.tools else {}
        return self.tokenizer().apply_chat_template(
            [{"role": "user", "content": case.question}],
            add_generation_prompt=True,
            tokenize=False,
            **case.options,
            **extra,
        )

    def prompt_ids(self, case: Case) -> list[int]:
        return self.tokenizer()(self.prompt(case), add_special_tokens=False)["input_ids"]

    def body(self, case: str, **fields) -> dict:
        """A chat request body asking `case`'s question as the case asks it."""
        c = self.cases[case]
        body = {"model": self.model, "messages": [{"role": "user", "content": c.question}], "temperature": 0}
        if c.options:
            body["chat_template_kwargs"] = c.options
        if c.tools:
            body["tools"] = c.tools
        return {**body, **fields}


QWEN3 = Family(
    "qwen3",
    "qwen3.jinja",
    {
        "think": Case(
            "Why is the sky blue?",
            "<think>\nThe user asks about the sky.\nRayleigh scattering.\n</think>\n\nBlue light scatters most.<|im_end|>",
        ),
        "no_think": Case(
            "Why is the sky blue? Please answer in one short sentence, and do not think about it at length: a plain answer will do.",
            "Blue light scatters most.<|im_end|>",
            options={"enable_thinking": False},
        ),
    },
)
DEEPSEEK_R1 = Family(
    "deepseek_r1",
    "deepseek-r1.jinja",
    {
        "think": Case(
            "Why is the sky blue?",
            "The user asks about the sky.\nRayleigh scattering.\n</think>\n\nBlue light scatters most.<｜end▁of▁sentence｜>",
        ),
    },
)
GPT_OSS = Family(
    "gpt_oss",
    "gpt-oss.jinja",
    {
        "think": Case(
            "Why is the sky blue?",
            "<|channel|>analysis<|message|>Rayleigh scattering.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Blue light scatters most.<|return|>",
        ),
        "tool": Case(
            "What is the weather in Paris?",
            "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
            tools=[WEATHER],
        ),
    },
)
REASONING_FAMILIES = (QWEN3, DEEPSEEK_R1, GPT_OSS)


def build_family(root: Path, family: Family) -> Path:
    """The family's scripted model in `root`: every case's script after its own prompt."""
    scripts = {len(family.prompt_ids(case)): case.script for case in family.cases.values()}
    assert len(scripts) == len(family.cases), f"two {family.name} cases have prompts of one length"
    tokenizer = family.tokenizer()
    reach = max(n + len(tokenizer.encode(text, add_special_tokens=False)) for n, text in scripts.items())
    hidden = max(1024, -(-reach // 256) * 256)  # a position each: long tool prompts need more than 1,024
    return build_scripted_model(
        root / family.name, family.name, (TEMPLATES / family.template).read_text(), scripts, hidden
    )
