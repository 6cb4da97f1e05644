"""Output and error lines for every endpoint, in the envelope the hosted batch API writes (each endpoint's
response body shaped by its own module: chat and completions here, embeddings and /v1/responses theirs)."""

from __future__ import annotations

import json
import time
from typing import Any

from bulkgen.batch.embeddings import EMBEDDINGS, embedding_body
from bulkgen.batch.ids import random_id
from bulkgen.batch.reasoning import choice_fields
from bulkgen.batch.requests import CHAT, RESPONSES, ParsedRequest
from bulkgen.batch.resp_api import output_text, response_body
from bulkgen.batch.structured import REQUIRED, forced_calls
from bulkgen.batch.tools import call_of, parse_tool_calls

NOT_RUN_MESSAGES = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
}


def envelope(custom_id: str, response: dict | None, error: dict | None) -> dict[str, Any]:
    return {"id": random_id("batch_req_"), "custom_id": custom_id, "response": response, "error": error}


def success_line(request: ParsedRequest, result: dict, model: str) -> dict[str, Any]:
    """`result`: the worker's finished-request dict (bulkgen.runtime.worker.result_dict)."""
    if request.endpoint == EMBEDDINGS:
        body = embedding_body(request.embedding, result, model)
    elif request.endpoint == CHAT:
        body = chat_body(
            result,
            model,
            request.tool_format,
            request.legacy_functions,
            request.forced_tool,
            request.tools,
            request.forced_syntax,
        )
    elif request.endpoint == RESPONSES:
        body = response_body(result, model, request.response_fields)
    else:
        body = completion_body(result, model)
    response = {"status_code": 200, "request_id": random_id("req_"), "body": body}
    return envelope(request.custom_id, response, None)


def refused_line(custom_id: str, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """A request the model endpoint refused (e.g. context_length_exceeded, 400) or failed on (500)."""
    status, error_type = (500, "server_error") if code == "engine_error" else (400, "invalid_request_error")
    error = {"message": message, "type": error_type, "param": param, "code": code}
    return envelope(
        custom_id, {"status_code": status, "request_id": random_id("req_"), "body": {"error": error}}, None
    )


def not_run_line(custom_id: str, code: str) -> dict[str, Any]:
    """A request never executed (cancelled, expired)."""
    return envelope(custom_id, None, {"code": code, "message": NOT_RUN_MESSAGES[code]})


def usage(result: dict) -> dict[str, Any]:
    prompt, completion = result["prompt_tokens"], result["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": result.get("cached_tokens", 0)},
        "completion_tokens_details": {"reasoning_tokens": result.get("reasoning_tokens", 0)},
    }


def chat_body(
    result: dict,
    model: str,
    tool_format: str | None = None,
    legacy: bool = False,
    forced: str | None = None,
    tools: list[dict] | None = None,
    forced_syntax: bool = False,
) -> dict[str, Any]:
    """`tool_format`: read tool calls out of the text (the request rendered tools; see bulkgen.batch.tools);
    `legacy`: they came as `functions`, so the (first) call is answered as message.function_call;
    `forced`: the output is a forced call (bulkgen.batch.structured), a document of JSON, not free text;
    `tools`: the request's tools (their schemas type the values of formats that write them as text);
    `forced_syntax`: the forced call is written in `tool_format`'s syntax, read back as a free call is.
    A call forced by name finishes with `stop`, as the hosted API answers; any other call with
    `tool_calls` (`function_call` for the legacy form)."""
    choices = [
        {
            "index": c["index"],
            "message": _message(c, tool_format, legacy, forced, tools, forced_syntax),
            "logprobs": {"content": [_chat_logprob(t) for t in c["logprobs"]], "refusal": None}
            if c.get("logprobs") is not None
            else None,
            "finish_reason": c["finish_reason"],
        }
        for c in result["completions"]
    ]
    for choice in choices:
        if forced not in (None, REQUIRED) and choice["finish_reason"] == "stop":
            continue
        if choice["message"].get("tool_calls"):
            choice["finish_reason"] = "tool_calls"
        elif choice["message"].get("function_call"):
            choice["finish_reason"] = "function_call"
    return {
        "id": random_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(result),
        "system_fingerprint": result.get("system_fingerprint"),
    }


def _message(
    completion: dict,
    tool_format: str | None,
    legacy: bool,
    forced: str | None = None,
    tools: list[dict] | None = None,
    forced_syntax: bool = False,
) -> dict[str, Any]:
    """The assistant message: its answer (content None where the reasoning took every token), its reasoning
    (a reasoning model's: bulkgen.batch.reasoning), or the tool calls read from it. A forced call's output is
    a JSON document (bulkgen.batch.structured) unless it was forced in the format's own syntax (then its
    reader reads it); cut by max_tokens it is no whole call, and stays the content."""
    text = completion.get("content", completion["text"])
    message = {"role": "assistant", "content": text, **choice_fields(completion), "refusal": None}
    if forced is not None and not forced_syntax:
        content, calls = None, forced_calls(text or "", forced) or []
    elif completion.get("calls"):  # read from harmony's channels
        content, calls = text, [call_of(c["name"], c["arguments"]) for c in completion["calls"]]
    elif tool_format is not None and text is not None:
        content, calls = parse_tool_calls(text, tool_format, tools)
    else:
        return message
    if calls:
        message["content"] = content
        if legacy:
            message["function_call"] = calls[0]["function"]
        else:
            message["tool_calls"] = calls
    return message


def _chat_logprob(token: dict) -> dict[str, Any]:
    return {
        "token": token["token"],
        "logprob": token["logprob"],
        "bytes": list(token["token"].encode()),
        "top_logprobs": [
            {"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode())}
            for t in token.get("top_logprobs", [])
        ],
    }


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
    return {
        "id": random_id("cmpl-"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(result),
        **({"system_fingerprint": result["system_fingerprint"]} if result.get("system_fingerprint") else {}),
    }


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


def answer_summary(body: dict) -> dict[str, Any]:
    """The text (None for embeddings), finish reason and token counts of any 200 answer body bulkgen
    writes (chat, completion, Response, embeddings): what previews and Parquet rows show."""
    if body.get("object") == "response":
        return {
            "text": output_text(body),
            "finish_reason": "length" if body["status"] == "incomplete" else "stop",
            "prompt_tokens": body["usage"]["input_tokens"],
            "completion_tokens": body["usage"]["output_tokens"],
        }
    if "data" in body:  # embeddings
        vectors = body["data"]
        return {
            "text": None,
            "finish_reason": None,
            "prompt_tokens": body["usage"]["prompt_tokens"],
            "completion_tokens": 0,
            "vectors": len(vectors),
            "dimensions": len(vectors[0]["embedding"]) if vectors else 0,
        }
    choice = body["choices"][0]
    return {
        "text": _message_text(choice["message"]) if "message" in choice else choice["text"],
        "finish_reason": choice["finish_reason"],
        "prompt_tokens": body["usage"]["prompt_tokens"],
        "completion_tokens": body["usage"]["completion_tokens"],
    }


def _message_text(message: dict) -> str:
    """A chat answer as one text: its content, or, for an answer that is tool calls (content null), each
    call as `name(arguments)`."""
    if message.get("content") is not None:
        return message["content"]
    calls = [c["function"] for c in message.get("tool_calls") or ()]
    calls += [message["function_call"]] if message.get("function_call") else []
    return "; ".join(f"{c['name']}({c['arguments']})" for c in calls) or (message.get("refusal") or "")


_LINE_BREAKS = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def json_line(obj: dict) -> bytes:
    """THE writer of every JSONL line bulkgen stores (result parts, output, error files): UTF-8 kept as is,
    except U+0085, U+2028 and U+2029, which str.splitlines() and JavaScript readers take for line breaks;
    they are written escaped, so every reader splits the file into exactly its lines."""
    text = json.dumps(obj, ensure_ascii=False)
    if any(c in text for c in _LINE_BREAKS):
        for raw, escaped in _LINE_BREAKS.items():
            text = text.replace(raw, escaped)
    return text.encode() + b"\n"
