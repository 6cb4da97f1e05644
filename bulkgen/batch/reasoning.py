"""Reasoning in a model's output -> the API's reasoning fields, for the two formats chat templates teach.

- think:   `<think>…</think>` then the answer (Qwen3, QwQ, DeepSeek-R1, GLM-4.5+, MiniMax-M2 and others). A
  template whose generation prompt opens `<think>` (DeepSeek-R1, Qwen3 thinking-2507) starts the output
  inside the reasoning, so only `</think>` comes; Qwen3 with `enable_thinking: false` writes an empty block
  into the prompt, and the output is all answer. The tags are ordinary (non-special) added tokens in these
  families, so they survive decoding and the text is read.
- harmony: gpt-oss's channels (`<|channel|>analysis<|message|>…<|end|>`, `final`, `commentary to=functions.X`).
  Its markers are special tokens, dropped by decoding, so it is read from the token ids.

The parser is chosen from what the chat template and tokenizer teach (`reasoning_parser`), as
bulkgen.batch.tools picks a call format; `--reasoning-parser NAME=PARSER` overrides it per model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

THINK, HARMONY, NONE = "think", "harmony", "none"
_THINK_START, _THINK_END = "<think>", "</think>"
# harmony's markers: a message is `<|start|>HEADER<|message|>BODY` closed by one of _ENDS
_START, _MESSAGE, _ENDS = "<|start|>", "<|message|>", ("<|end|>", "<|return|>", "<|call|>")
_MARKERS = (_START, _MESSAGE, *_ENDS, "<|channel|>", "<|constrain|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass
class Reading:
    """One choice's output read back: what goes to `content`, to `reasoning`, and the calls harmony made."""

    content: str | None
    reasoning: str | None = None
    reasoning_tokens: int = 0  # tokens the model spent before its answer (tags and channel headers included)
    calls: list[dict[str, str]] = field(default_factory=list)  # harmony: {"name", "arguments"} each


def reasoning_parser(template: str | None, tokenizer) -> str | None:
    """The reasoning format a chat template teaches (None: it teaches none, the output is all answer)."""
    if not template:
        return None
    if "<|channel|>" in template and _single_token(tokenizer, "<|channel|>"):
        return HARMONY
    if _THINK_END in template and _single_token(tokenizer, _THINK_END):
        return THINK
    return None


def opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt's generation prompt opens `<think>` (the output starts in its reasoning).
    Only its end counts: a `<think>` a user wrote in a message opens nothing."""
    return prompt.rstrip().endswith(_THINK_START)


def read_output(parser: str, text: str, token_ids: list[int], tokenizer, opened: bool = False) -> Reading:
    """A choice's output (`text` decoded without special tokens, `token_ids` as generated) as its fields."""
    if parser == HARMONY:
        return _read_harmony(token_ids, tokenizer)
    return _read_think(text, token_ids, tokenizer, opened)


def _read_think(text: str, token_ids: list[int], tokenizer, opened: bool) -> Reading:
    stripped = text.lstrip()
    started = stripped.startswith(_THINK_START)
    if _THINK_END not in text:
        if not (opened or started):  # no reasoning (e.g. closed by the template, as GLM's enable_thinking:
            return Reading(text.lstrip("\n"))  # false): the answer, without the newline that follows </think>
        reasoning = stripped.removeprefix(_THINK_START) if started else text
        return Reading(None, reasoning.strip("\n") or None, len(token_ids))  # cut inside its reasoning
    reasoning, _, answer = text.partition(_THINK_END)
    reasoning = reasoning.lstrip().removeprefix(_THINK_START).strip("\n")
    end_id = tokenizer.convert_tokens_to_ids(_THINK_END)
    spent = (
        token_ids.index(end_id) + 1
        if end_id in token_ids
        else len(tokenizer.encode(text.partition(_THINK_END)[0], add_special_tokens=False))
    )
    return Reading(answer.lstrip("\n"), reasoning or None, spent)


@dataclass
class _Message:
    header: list[int] = field(default_factory=list)
    body: list[int] = field(default_factory=list)
    in_body: bool = False
    tokens: int = 0
    end: str | None = None


def _read_harmony(token_ids: list[int], tokenizer) -> Reading:
    messages = _harmony_messages(token_ids, tokenizer)
    reasoning, answer, calls, spent = [], [], [], 0
    for m in messages:
        header = tokenizer.decode(m.header, skip_special_tokens=False)
        body = tokenizer.decode(m.body, skip_special_tokens=True)
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        channel = channel.group(1) if channel else None
        if recipient and recipient.group(1).startswith("functions."):
            calls.append({"name": recipient.group(1).removeprefix("functions."), "arguments": body.strip()})
        elif channel == "analysis":
            reasoning.append(body)
            spent += m.tokens
        elif m.in_body:  # final, a commentary preamble, or a channel never named
            answer.append(body)
        elif "<|" in header:  # a header cut off by max_tokens: no text yet, spent before any answer
            spent += m.tokens
        else:  # text outside any message (no markers at all): the model's plain answer
            answer.append(tokenizer.decode(m.header, skip_special_tokens=True))
    content = "".join(answer) if answer else None
    return Reading(content, "\n".join(reasoning) if reasoning else None, spent, calls)


def _harmony_messages(token_ids: list[int], tokenizer) -> list[_Message]:
    """The output's messages: the first starts at once (the generation prompt ends `<|start|>assistant`)."""
    marks = {tokenizer.convert_tokens_to_ids(m): m for m in _MARKERS}
    messages, current = [], _Message()
    for token in token_ids:
        mark = marks.get(token)
        if mark == _START and (current.tokens or current.header):
            messages.append(current)
            current = _Message()
        current.tokens += 1
        if mark == _MESSAGE:
            current.in_body = True
        elif mark in _ENDS:
            current.end = mark
            messages.append(current)
            current = _Message()
        elif mark != _START:
            (current.body if current.in_body else current.header).append(token)
    if current.tokens:
        messages.append(current)
    return messages


def _single_token(tokenizer, text: str) -> bool:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(ids) == 1


def read_by(parser: str | None) -> tuple[str, ...]:
    """The marker tokens `parser` reads an output by, kept when decoding it where they are special tokens
    (bulkgen.batch.special_tokens); harmony reads the token ids themselves."""
    return (_THINK_START, _THINK_END) if parser == THINK else ()


def read_choices(
    result: dict[str, Any], token_ids: list[list[int]], parser: str, opened: bool, tokenizer
) -> None:
    """Read each choice of a finished request (the worker's result dict; `token_ids[i]` its i-th choice's
    tokens) on its own: its `content` (None: no answer), `reasoning`, `reasoning_tokens` and harmony's
    `calls`; `text` becomes the answer alone. The result's `reasoning_tokens` sums its choices'."""
    for completion, ids in zip(result["completions"], token_ids, strict=True):
        reading = read_output(parser, completion["text"], ids, tokenizer, opened)
        completion.update(
            text=reading.content or "",
            content=reading.content,
            reasoning=reading.reasoning,
            reasoning_tokens=reading.reasoning_tokens,
            calls=reading.calls,
        )
    result["reasoning_tokens"] = sum(c["reasoning_tokens"] for c in result["completions"])


def choice_fields(completion: dict[str, Any]) -> dict[str, Any]:
    """The message fields a read choice adds (none where its model's output was not read for reasoning)."""
    if "reasoning" not in completion:
        return {}
    return {"reasoning": completion["reasoning"], "reasoning_content": completion["reasoning"]}
