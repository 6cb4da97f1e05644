"""A request line made ready for the engine: chat template, tokenize, fit the context.

Runs inside the worker actors, which hold the model's real tokenizer and the engine's real context
limit (`Engine.max_model_len`, which already accounts for sliding windows): this is the one place
that decides whether a request fits, and the driver never needs the model at all.
"""

from __future__ import annotations

from typing import Any

from bulkgen.batch.requests import LineError, ParsedRequest


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
