"""Output and error lines for every endpoint, in the envelope the hosted batch API writes (each endpoint's
response body shaped by its own module in bulkgen.batch.endpoints)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from bulkgen.batch.endpoints import ENDPOINTS
from bulkgen.batch.endpoints.responses import output_text
from bulkgen.batch.ids import random_id

if TYPE_CHECKING:
    from bulkgen.batch.requests import ParsedRequest

NOT_RUN_MESSAGES = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
}


def envelope(custom_id: str, response: dict | None, error: dict | None) -> dict[str, Any]:
    return {"id": random_id("batch_req_"), "custom_id": custom_id, "response": response, "error": error}


def success_line(request: ParsedRequest, result: dict, model: str) -> dict[str, Any]:
    """`result`: the worker's finished-request dict (bulkgen.runtime.worker.result_dict)."""
    body = ENDPOINTS[request.endpoint].answer(request, result, model)
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
