"""Turn a validated input file into engine work: chat template, tokenize, fit the context, sort, chunk.

Offline work is known up front, so the whole file is sorted by total work (prompt + output budget,
longest first): long requests start early instead of straggling at the end, and neighbours in a chunk
have similar lengths. The chunk plan is persisted so a resumed runner checkpoints the same parts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from bulkgen.batch.requests import LineError, ParsedRequest, parse_line
from bulkgen.batch.responses import refused_line


@dataclass
class WorkItem:
    request: ParsedRequest
    prompt_token_ids: list[int]
    params: dict[str, Any]          # SamplingParams kwargs, max_tokens resolved

    @property
    def work(self) -> int:
        return len(self.prompt_token_ids) + self.params["max_tokens"] * self.params.get("n", 1)


def tokenize(request: ParsedRequest, tokenizer) -> list[int]:
    if request.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise LineError("model_not_chat", "this model has no chat template; use /v1/completions", "body.messages")
        text = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if isinstance(request.prompt, list):
        if max(request.prompt) >= len(tokenizer):
            raise LineError("invalid_prompt", f"a token id in body.prompt is outside the vocabulary ({len(tokenizer)})",
                            "body.prompt")
        return list(request.prompt)
    return tokenizer(request.prompt)["input_ids"]


def fit_context(request: ParsedRequest, prompt_len: int, max_model_len: int) -> dict[str, Any]:
    """Resolve max_tokens (None: the rest of the context) and refuse what cannot fit, as the hosted API does."""
    params = {k: v for k, v in request.sampling.items() if v is not None}
    budget = max_model_len - prompt_len
    max_tokens = params.get("max_tokens") or budget
    if budget < 1 or max_tokens > budget:
        raise LineError(
            "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
            "messages" if request.messages is not None else "prompt",
        )
    params["max_tokens"] = max_tokens
    return params


def prepare(lines: Iterable[bytes], endpoint: str, tokenizer, max_model_len: int):
    """-> (work items by line, refused output lines by line)."""
    items: dict[int, WorkItem] = {}
    refused: dict[int, dict] = {}
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        request = parse_line(raw, number, endpoint)  # validated already: a failure here is a bug
        try:
            ids = tokenize(request, tokenizer)
            items[number] = WorkItem(request, ids, fit_context(request, len(ids), max_model_len))
        except LineError as err:
            refused[number] = refused_line(request.custom_id, err.message, err.code, err.param)
    return items, refused


def make_plan(items: dict[int, WorkItem], chunk_size: int) -> list[list[int]]:
    order = sorted(items, key=lambda line: (-items[line].work, line))
    return [order[i:i + chunk_size] for i in range(0, len(order), chunk_size)]


def plan_to_bytes(chunks: list[list[int]]) -> bytes:
    return json.dumps({"chunks": chunks}).encode()


def plan_from_bytes(data: bytes) -> list[list[int]]:
    return json.loads(data)["chunks"]
