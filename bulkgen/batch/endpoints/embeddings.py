"""The `/v1/embeddings` endpoint's lines: OpenAI's CreateEmbeddingRequest body in, CreateEmbeddingResponse out.

A line's `input` (a string, a list of strings, a token list or a list of token lists; at most 2,048 inputs, as
the API) becomes one engine request per input, like a completions line's several prompts, and their vectors
come back as `data[i]` in input order. `encoding_format` base64 is the vector's little-endian float32 bytes,
as the openai SDK decodes them. `dimensions` is checked here for its type; whether the model may truncate
(a matryoshka model, bulkgen.engine.features.pooling) is the worker's judgement, as that line's 400.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from bulkgen.batch.bodyfields import EMBEDDINGS, LineError, check_ignored, check_refused, invalid
from bulkgen.batch.endpoints.base import Endpoint

__all__ = ["EMBEDDINGS", "embedding_body", "fit_input", "parse_embedding"]
MAX_INPUTS = 2048
ENCODINGS = ("float", "base64")


def parse_embedding(body: dict[str, Any], request) -> Any:
    """Fill `request` (a ParsedRequest) from an embeddings body; LineError names the field."""
    check_refused(body, EMBEDDINGS)
    check_ignored(body)
    inputs = parse_inputs(body.get("input"))
    request.prompt, request.prompts = inputs[0], (inputs if len(inputs) > 1 else None)
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise invalid("encoding_format", "must be 'float' or 'base64'", encoding)
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1
    ):
        raise invalid("dimensions", "must be a positive integer", dimensions)
    request.embedding = {"encoding_format": encoding, "dimensions": dimensions}
    request.sampling = {"max_tokens": 0}  # prefill only: what the line index counts as its work
    return request


def parse_inputs(value: Any) -> list[str | list[int]]:
    """The inputs of `body.input`, each a non-empty string or a non-empty list of token ids."""
    if isinstance(value, str) or _is_tokens(value):
        inputs = [value]
    elif (
        isinstance(value, list)
        and value
        and (all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value))
    ):
        inputs = value
    else:
        raise invalid(
            "input",
            "must be a string, a list of strings, a list of token ids or a list of lists of token ids",
            value,
        )
    if len(inputs) > MAX_INPUTS:
        raise LineError(
            "invalid_parameter",
            f"body.input has {len(inputs)} inputs; at most {MAX_INPUTS} are allowed per request",
            "body.input",
        )
    for i, item in enumerate(inputs):
        if isinstance(item, list) and item and not _is_tokens(item):
            raise invalid(f"input[{i}]", "must be a list of token ids", item)
        if not item:
            raise LineError(
                "invalid_parameter",
                f"body.input[{i}] is empty; every input needs text or tokens",
                "body.input",
            )
        if isinstance(item, list) and min(item) < 0:
            raise LineError("invalid_parameter", f"body.input[{i}] holds a negative token id", "body.input")
    return inputs


def _is_tokens(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def fit_input(prompt_len: int, max_model_len: int) -> None:
    """An input longer than the context is refused (the API does not truncate it either)."""
    if prompt_len > max_model_len:
        raise LineError(
            "context_length_exceeded",
            f"This model's maximum context length is {max_model_len} "
            f"tokens, however an input of {prompt_len} tokens was given. Please reduce the input.",
            "body.input",
        )


def fit(request, prompt_len: int, max_model_len: int) -> dict[str, Any]:
    """Prefill only: the engine's EmbedParams."""
    fit_input(prompt_len, max_model_len)
    return {"dimensions": request.embedding["dimensions"]}


def answer(request, result: dict, model: str) -> dict[str, Any]:
    return embedding_body(request.embedding, result, model)


def embedding_body(options: dict, result: dict, model: str) -> dict[str, Any]:
    """The CreateEmbeddingResponse of one line (`options`: ParsedRequest.embedding): `result["completions"]`
    carry each input's vector by index."""
    encoding = options["encoding_format"]
    data = [
        {"object": "embedding", "index": c["index"], "embedding": encode(c["embedding"], encoding)}
        for c in sorted(result["completions"], key=lambda c: c["index"])
    ]
    tokens = result["prompt_tokens"]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


ENDPOINT = Endpoint(EMBEDDINGS, "body.input", {"input": "x"}, parse=parse_embedding, answer=answer, fit=fit)
