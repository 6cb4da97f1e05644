"""`/v1/completions` lines: a CreateCompletionRequest body in (one prompt or several, each in the spec's
forms; logprobs as a count, best_of, echo), a `text_completion` out; a line's several prompts run as one
engine request each (bulkgen.batch.prepare.split_prompts) and come back merged (`merge_results`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bulkgen.batch.bodyfields import (
    COMPLETIONS,
    HONOURED_COMMON,
    LineError,
    check_ignored,
    check_refused,
    invalid,
)
from bulkgen.batch.endpoints.base import Endpoint, choices_body
from bulkgen.batch.sampling import best_of, completion_logprobs, sampling
from bulkgen.batch.schema import quote

if TYPE_CHECKING:
    from bulkgen.batch.requests import ParsedRequest


def parse(body: dict[str, Any], request: ParsedRequest) -> ParsedRequest:
    check_refused(body, COMPLETIONS)
    check_ignored(body)
    all_prompts = prompts(body.get("prompt"))
    request.prompt, request.prompts = all_prompts[0], (all_prompts if len(all_prompts) > 1 else None)
    request.echo = body.get("echo") is True
    request.sampling = sampling(body, completion_logprobs, "logprobs", best_of)
    return request


def answer(request: ParsedRequest, result: dict, model: str) -> dict[str, Any]:
    return completion_body(result, model)


MAX_PROMPTS = 128


def prompts(value: Any) -> list[str | list[int]]:
    """The spec's four prompt forms as a list of prompts: a string (empty or null: the start of a document, as
    the API's default), token ids, a list of strings, a list of token-id lists."""
    if value is None or isinstance(value, str):
        return [value or ""]
    if _token_ids(value):
        return [value]
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(p, str) or _token_ids(p) for p in value)
    ):
        raise LineError(
            "invalid_prompt",
            "body.prompt must be a string, a non-empty list of token ids (ints "
            f">= 0), or a list of either; got {quote(value)}",
            "body.prompt",
        )
    if len(value) > MAX_PROMPTS:
        raise invalid(
            "prompt",
            f"may hold at most {MAX_PROMPTS} prompts (put the rest on other lines)",
            f"{len(value)} prompts",
        )
    return value


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


def merge_results(results: list[dict], n: int) -> dict[str, Any]:
    """The results of a completions line's several prompts (one engine request each) as the line's one result:
    prompt i's choices get the indices i*n .. i*n+n-1, as the API numbers them; usage is summed."""
    merged = {**results[0], "completions": [], "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    for i, result in enumerate(results):
        for key in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            merged[key] += result.get(key, 0)
        merged["completions"] += [{**c, "index": i * n + c["index"]} for c in result["completions"]]
    return merged


def completion_body(result: dict, model: str) -> dict[str, Any]:
    """A completion's `echo` (the request asked for it): its prompt's text leads the choice's text, and the
    prompt's tokens (`prompt_logprobs`) lead the logprobs (the first prompt token has none, as the API answers)."""
    choices = []
    for c in result["completions"]:
        tokens, echo = c.get("logprobs"), c.get("echo")
        if echo is not None and tokens is not None:
            first = {"token": echo["first_token"], "logprob": None, "top_logprobs": None}
            tokens = [first, *(c.get("prompt_logprobs") or []), *tokens]
        choices.append(
            {
                "text": (echo["text"] if echo else "") + c["text"],
                "index": c["index"],
                "logprobs": _completion_logprobs(tokens),
                "finish_reason": c["finish_reason"],
            }
        )
    body = choices_body("cmpl-", "text_completion", model, choices, result)
    fingerprint = result.get("system_fingerprint")
    return {**body, "system_fingerprint": fingerprint} if fingerprint else body


def _completion_logprobs(tokens: list[dict] | None) -> dict[str, Any] | None:
    if tokens is None:
        return None
    offsets, offset = [], 0
    for t in tokens:
        offsets.append(offset)
        offset += len(t["token"])
    return {
        "tokens": [t["token"] for t in tokens],
        "token_logprobs": [t["logprob"] for t in tokens],
        "top_logprobs": [
            None if t.get("top_logprobs") is None else {a["token"]: a["logprob"] for a in t["top_logprobs"]}
            for t in tokens
        ],
        "text_offset": offsets,
    }


# CreateCompletionRequest's fields, and vLLM's sampling extensions (bulkgen.batch.sampling)
FIELDS = frozenset(HONOURED_COMMON | {"prompt", "best_of", "echo", "suffix", "user", "stream_options"})
EXTENSIONS = frozenset({"top_k", "min_p", "repetition_penalty"})

ENDPOINT = Endpoint(
    COMPLETIONS,
    "body.prompt",
    {"prompt": "x"},
    fields=FIELDS,
    parse=parse,
    answer=answer,
    extensions=EXTENSIONS,
)
