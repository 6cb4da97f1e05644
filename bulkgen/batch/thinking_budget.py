"""A line's `thinking_token_budget` (vLLM's field) and the reasoning gate its request runs under.

With a reasoning parser on (bulkgen.batch.reasoning), a request that has a budget or a grammar (response_format,
a forced tool call) runs under the engine's reasoning gate (bulkgen.engine.features.reasoning_gate): the budget forces
the family's end of reasoning, and the grammar constrains only the answer after it. Without a parser (none
taught by the template, or `--reasoning-parser NAME=none`) a budget is accepted and ignored (vLLM's acts only
where its reasoning config names start and end tokens); the grammar then applies from the first token.
"""

from __future__ import annotations

from typing import Any

from bulkgen.batch.bodyfields import invalid
from bulkgen.batch.reasoning import HARMONY, THINK

FIELD = "thinking_token_budget"
# what ends each family's reasoning, and what leads from that end to the answer (the real templates write
# `</think>\n\n` before an answer; harmony's answer is the final channel's message)
_MARKS = {
    THINK: ("<think>", "</think>", "\n\n"),
    HARMONY: ("<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant<|channel|>final<|message|>"),
}


def thinking_budget(body: dict[str, Any]) -> int | None:
    """The line's budget: a non-negative integer, or None where it sets none."""
    value = body.get(FIELD)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise invalid(FIELD, "must be a non-negative integer", value)
    return value


def gate_reasoning(
    sampling: dict[str, Any], parser: str | None, opened: bool, prompt: str, budget, tokenizer
):
    """Put the reasoning gate into `sampling` (SamplingParams kwargs) where the request needs one: a reasoning
    parser, and a budget or a grammar; the prompt did not close the reasoning (Qwen3's enable_thinking
    false writes an empty block: the output is all answer)."""
    marks = _MARKS.get(parser or "")
    if marks is None or (budget is None and sampling.get("guide") is None):
        return
    if parser == THINK and prompt.rstrip().endswith(marks[1]):
        return
    from bulkgen.engine.features.reasoning_gate import (
        ReasoningSpec,  # the engine's: only workers prepare lines
    )

    ids = [tuple(tokenizer.encode(text, add_special_tokens=False)) for text in marks]
    sampling["reasoning"] = ReasoningSpec(*ids, opened=opened, budget=budget)
