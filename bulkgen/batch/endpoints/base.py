"""What every endpoint module defines (`Endpoint`), and the body chat and completions answer with around their
choices (`choices_body`, with its `usage`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bulkgen.batch.ids import random_id

if TYPE_CHECKING:
    from bulkgen.batch.requests import ParsedRequest


@dataclass(frozen=True)
class Endpoint:
    """One endpoint a batch line may name: its module's functions, looked up once by the line's url."""

    url: str  # the line's `url` (and the batch's `endpoint`), in its '/v1/' form
    input_field: str  # the body field the prompt comes from, as errors name it
    sample_input: dict[
        str, Any
    ]  # the least body input a request needs (a watcher job tries its defaults with it)
    fields: frozenset[
        str
    ]  # the body's fields in OpenAI's spec (the request's create params); others are refused
    parse: Callable[[dict[str, Any], ParsedRequest], ParsedRequest]
    # fill the request from the body (its unknown fields already refused); any LineError refuses the line
    answer: Callable[[ParsedRequest, dict, str], dict[str, Any]]
    # the 200 response body from the worker's result (bulkgen.runtime.worker.result_dict) and the model name
    fit: Callable[[ParsedRequest, int, int], dict[str, Any]] | None = None
    # (request, prompt_len, max_model_len) -> the engine's params, where they are not a generation's
    # (bulkgen.batch.prepare.fit_context); LineError where the prompt cannot fit
    extensions: frozenset[str] = frozenset()  # vLLM's fields beyond the spec, honoured as vLLM honours them


def usage(result: dict) -> dict[str, Any]:
    prompt, completion = result["prompt_tokens"], result["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": result.get("cached_tokens", 0)},
        "completion_tokens_details": {"reasoning_tokens": result.get("reasoning_tokens", 0)},
    }


def choices_body(id_prefix: str, kind: str, model: str, choices: list[dict], result: dict) -> dict[str, Any]:
    """A chat.completion's or text_completion's fields up to its usage (the choices are the endpoint's)."""
    return {
        "id": random_id(id_prefix),
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(result),
    }
