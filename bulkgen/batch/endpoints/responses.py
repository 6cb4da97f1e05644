"""The Responses API in batches (`/v1/responses` lines): a front door to the chat request, and its answer.

`responses_request` turns a CreateResponse body into the ParsedRequest a chat line makes (messages, sampling
with its grammar, template options), so the worker, the chat template and the engine run it exactly as chat;
`response_body` turns the engine's result into a `Response` object, the one part that differs. The fields
(docs/responses.md has the table):
- honoured: input (a string, or message items with text parts; user items' input_image parts, see
  bulkgen.batch.images), instructions (a system message first),
  max_output_tokens, temperature, top_p, text.format (text, json_object, json_schema: the structured-outputs
  grammar of bulkgen.batch.structured), reasoning.effort (to the chat template, as chat's reasoning_effort),
  metadata (echoed in the Response);
- accepted and ignored, type-checked: hints about the hosted service that cannot change the text (store,
  user, service_tier, prompt caching, truncation, text.verbosity, ...), and tool settings with no tools;
- refused by name as that line's 400: what needs tools, stored state (conversations, previous responses,
  prompt templates), streaming, audio and file parts, logprobs or reasoning summaries (a reasoning model's
  reasoning comes whole, as a `reasoning` item before the message: bulkgen.batch.reasoning).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from bulkgen.batch.bodyfields import RESPONSES, LineError, check_ignored, check_refused, invalid, unsupported
from bulkgen.batch.endpoints.base import Endpoint
from bulkgen.batch.ids import random_id
from bulkgen.batch.images import DETAILS, ImageRef, image_ref
from bulkgen.batch.messages import ImageParts, template_kwargs, text_parts
from bulkgen.batch.sampling import sampling
from bulkgen.batch.schema import InvalidRequest, check_metadata, quote
from bulkgen.batch.structured import json_schema_guide
from bulkgen.engine.features.guide import Guide

if TYPE_CHECKING:
    from bulkgen.batch.requests import ParsedRequest

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_ITEM_KEYS = {"type", "role", "content", "id", "status", "phase"}
_ITEM_HINTS = {
    "id": (),
    "status": ("in_progress", "completed", "incomplete"),
    "phase": ("commentary", "final_answer"),
}
_MEDIA_PARTS = {"input_image", "input_file", "input_audio"}
_IMAGE_KEYS = {"type", "image_url", "file_id", "detail", "prompt_cache_breakpoint"}
_DETAILS = (*DETAILS, "original")  # the hosted API's full resolution; a processor resizes as it always does
_PARTS = {"input_text": "text"}  # part type -> its text key
_ASSISTANT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
_EFFORTS = {"none", "minimal", "low", "medium", "high", "xhigh", "max"}
_SAMPLING = ("max_output_tokens", "temperature", "top_p")
MIN_OUTPUT_TOKENS = 16  # CreateResponse.max_output_tokens: `minimum: 16` in OpenAI's spec
HISTORY = "send the whole conversation in body.input"
# Refused unless null or one of the values that leave the result alone: field -> (those values, why not more).
_REFUSED: dict[str, tuple[tuple, str]] = {
    "tools": (([],), "is not supported on /v1/responses (use /v1/chat/completions for function calling)"),
    "tool_choice": (("none", "auto"), "may only be 'none' or 'auto': the request has no tools"),
    "include": (
        ([],),
        "asks for output data (logprobs, tool sources, encrypted reasoning) bulkgen does not return",
    ),
    "top_logprobs": (
        (0,),
        "needs logprobs, which /v1/responses does not return here (use /v1/chat/completions)",
    ),
    "background": ((False,), "is for the hosted API: a batch line already runs in the background"),
    "background_options": ((), "is for the hosted API's background mode"),
    "conversation": ((), f"needs a stored conversation, which a batch does not have; {HISTORY}"),
    "previous_response_id": ((), f"needs stored responses, which a batch does not have; {HISTORY}"),
    "prompt": ((), "needs a stored prompt template; put its text in body.instructions and body.input"),
    "context_management": ((), f"compacts a stored conversation; {HISTORY}"),
    "image": ((), "sets image options; this model is text-only"),
}


def responses_request(body: dict, request: ParsedRequest) -> ParsedRequest:
    """Fill `request` (endpoint, identity set) from a CreateResponse body; any LineError refuses the line."""
    _check_refused(body)
    check_refused(body, RESPONSES)  # stream and moderation, as every endpoint refuses them
    check_ignored(body)
    _check_ignored_here(body)
    request.messages = _messages(body.get("input"), body.get("instructions"), request.images)
    effort = _effort(body.get("reasoning"))
    request.template_kwargs = template_kwargs({"reasoning_effort": effort})
    _check_output_limit(body.get("max_output_tokens"))
    request.sampling = sampling({name: body.get(name) for name in _SAMPLING})
    fmt, guide = _text_format(body.get("text"))
    if guide is not None:
        request.sampling["guide"], request.guide_param = guide, "body.text.format"
    request.limit_field = "max_output_tokens"
    request.response_fields = _echoed(body, request.sampling, fmt, effort)
    return request


def _check_output_limit(limit: Any) -> None:
    """The spec's minimum (the hosted API refuses less); the type and the upper end are sampling's rules."""
    if type(limit) is int and limit < MIN_OUTPUT_TOKENS:
        raise invalid("max_output_tokens", f"must be an integer >= {MIN_OUTPUT_TOKENS}", limit)


def _check_refused(body: dict) -> None:
    for name, (allowed, why) in _REFUSED.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
            raise unsupported(name, why)


def _check_ignored_here(body: dict) -> None:
    """The Responses API's own hints (bodyfields.IGNORED checks those it shares with chat)."""
    truncation, calls, programs = (
        body.get("truncation"),
        body.get("max_tool_calls"),
        body.get("access_programs"),
    )
    if truncation is not None and truncation not in ("auto", "disabled"):
        raise invalid("truncation", "must be 'auto' or 'disabled'", truncation)
    if calls is not None and (type(calls) is not int or calls < 0):
        raise invalid("max_tool_calls", "must be an integer >= 0", calls)
    if programs is not None and not isinstance(programs, dict):
        raise invalid("access_programs", "must be an object", programs)


def _messages(value: Any, instructions: Any, images: list[ImageRef]) -> list[dict[str, Any]]:
    """`instructions` as the first (system) message, then `input`: a string is one user message. The
    references of user items' input_image parts are appended to `images`."""
    out = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", "must be a string", instructions)
        out.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        return [*out, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise LineError(
            "invalid_input",
            f"body.input must be a string or a non-empty list of message items; got {quote(value)}",
            "body.input",
        )
    return out + [_item(item, f"body.input[{i}]", images) for i, item in enumerate(value)]


def _item(item: Any, param: str, images: list[ImageRef]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise LineError(
            "invalid_input",
            f"{param} must be a message item ({{'role': ..., 'content': ...}}); got {quote(item)}",
            param,
        )
    kind = item.get("type", "message")
    if kind != "message":
        raise LineError(
            "unsupported_parameter",
            f"{param} is a {quote(kind)} item; /v1/responses takes message "
            "items only here (tool calls and stored items need tools or stored state)",
            f"{param}.type",
        )
    _check_keys(item, _ITEM_KEYS, param, "a message item")
    for key, allowed in _ITEM_HINTS.items():  # a replayed output item's own fields: checked, not used
        if item.get(key) is not None and not (
            isinstance(item[key], str) and (not allowed or item[key] in allowed)
        ):
            rule = " or ".join(map(repr, allowed)) or "a string"
            raise LineError(
                "invalid_input", f"{param}.{key} must be {rule}; got {quote(item[key])}", f"{param}.{key}"
            )
    role = item.get("role")
    if role not in _ROLES:
        raise LineError(
            "invalid_input",
            f"{param}.role must be one of {sorted(_ROLES)}; got {quote(role)}",
            f"{param}.role",
        )
    return {"role": _ROLES[role], "content": _content(item.get("content"), param, role, images)}


def _check_keys(obj: dict, known: set[str], param: str, what: str) -> None:
    unknown = sorted(set(obj) - known)
    if unknown:
        raise LineError(
            "invalid_input",
            f"{param}.{quote(unknown[0], 40)} is not a field of {what}",
            f"{param}.{unknown[0][:64]}",
        )


def _content(content: Any, param: str, role: str, images: list[ImageRef]) -> str | list[dict]:
    """A string, or text parts joined: input_text (any role); output_text and refusal (assistant history);
    input_image parts in a user item (the parts list, then)."""
    parts = _ASSISTANT_PARTS if role == "assistant" else _PARTS
    found = ImageParts("input_image", _input_image, images) if role == "user" else None
    return text_parts(content, param, parts, _MEDIA_PARTS, "invalid_input", found)


def _input_image(part: dict, where: str) -> ImageRef:
    """{"type": "input_image", "image_url": ... | "file_id": ..., "detail": ...}: exactly one source."""
    _check_keys(part, _IMAGE_KEYS, where, f"an input_image part ({sorted(_IMAGE_KEYS)})")
    url, file_id = part.get("image_url"), part.get("file_id")
    if (url is None) == (file_id is None):
        raise LineError(
            "invalid_input",
            f"{where} must set exactly one of image_url and file_id; got {quote(part)}",
            where,
        )
    field = "image_url" if url is not None else "file_id"
    source = url if url is not None else file_id
    if field == "file_id" and isinstance(source, str) and not source.startswith("file-"):
        raise LineError(
            "invalid_input",
            f"{where}.file_id must be a file id (file-…); got {quote(source)}",
            f"{where}.file_id",
        )
    return image_ref(source, part.get("detail"), f"{where}.{field}", f"{where}.detail", _DETAILS)


def _effort(reasoning: Any) -> str | None:
    """reasoning.effort goes to the chat template (where it takes one); summaries are refused: a reasoning
    model's reasoning is returned whole (the reasoning item's content), and a summary of it would need a
    second generation bulkgen does not make."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict) or not set(reasoning) <= {
        "effort",
        "summary",
        "generate_summary",
        "context",
        "mode",
    }:
        raise invalid("reasoning", "must be an object of effort, summary, context and mode", reasoning)
    for name in ("summary", "generate_summary"):
        if reasoning.get(name) is not None:
            raise unsupported(
                f"reasoning.{name}",
                "asks for a reasoning summary, which bulkgen does not write (a reasoning model's reasoning "
                "comes whole, as the reasoning item's content)",
            )
    if reasoning.get("mode") not in (None, "standard"):
        raise unsupported("reasoning.mode", f"may only be 'standard'; got {quote(reasoning['mode'])}")
    if reasoning.get("context") not in (None, "auto", "current_turn", "all_turns"):
        raise invalid(
            "reasoning.context", "must be 'auto', 'current_turn' or 'all_turns'", reasoning["context"]
        )
    effort = reasoning.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise invalid("reasoning.effort", f"must be one of {sorted(_EFFORTS)}", effort)
    return effort


def _text_format(text: Any) -> tuple[dict, Guide | None]:
    """text.format -> (the format as the Response repeats it, its grammar or None for free text)."""
    if text is None:
        return {"type": "text"}, None
    if not isinstance(text, dict) or not set(text) <= {"format", "verbosity"}:
        raise invalid("text", "must be an object of format and verbosity", text)
    if text.get("verbosity") not in (None, "low", "medium", "high"):
        raise invalid("text.verbosity", "must be 'low', 'medium' or 'high'", text["verbosity"])
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or (kind == "text" and set(fmt) == {"type"}):
        return {"type": "text"}, None
    if kind == "json_object" and set(fmt) == {"type"}:
        return fmt, Guide.json_object()
    if kind != "json_schema":
        raise invalid(
            "text.format",
            "must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
            "'json_schema', 'name': ..., 'schema': {...}}",
            fmt,
        )
    spec = {k: v for k, v in fmt.items() if k != "type"}
    return fmt, json_schema_guide(spec, "text.format", "text.format")


def _metadata(value: Any) -> dict[str, str]:
    try:
        return check_metadata(value) or {}
    except InvalidRequest as err:
        raise LineError("invalid_parameter", f"body.{err.message}", f"body.{err.param}") from None


def _echoed(body: dict, params: dict, fmt: dict, effort: str | None) -> dict[str, Any]:
    """The request fields a Response object repeats, as the hosted API fills them when not set."""
    verbosity = (body.get("text") or {}).get("verbosity") or "medium"
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": _metadata(body.get("metadata")),
        "temperature": params.get("temperature", 1.0),
        "top_p": params.get("top_p", 1.0),
        "text": {"format": fmt, "verbosity": verbosity},
        "reasoning": {"effort": effort, "summary": None},
        "store": body.get("store") is not False,
        "truncation": body.get("truncation") or "disabled",
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "tool_choice": body.get("tool_choice") or "auto",
        "max_tool_calls": body.get("max_tool_calls"),
        "top_logprobs": 0,
        "user": body.get("user"),
        "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "service_tier": "default",  # the tier that served it: a self-hosted run has one
    }


def response_body(result: dict, model: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The engine's result (one completion) as a `Response`; `fields`: ParsedRequest.response_fields.
    Cut by the token limit, it is `incomplete` with reason max_output_tokens, as the hosted API answers."""
    completion = result["completions"][0]
    cut = completion["finish_reason"] == "length"
    status = "incomplete" if cut else "completed"
    arrived = (result.get("metrics") or {}).get("arrival_time") or time.time()
    return {
        "id": random_id("resp_"),
        "object": "response",
        "created_at": int(arrived),
        "status": status,
        "completed_at": None if cut else int(result.get("finished_at") or time.time()),
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "model": model,
        "output": _output(completion, status),
        "usage": _usage(result),
        "tools": [],
        "previous_response_id": None,
        "background": False,
        **fields,
    }


def answer(request: ParsedRequest, result: dict, model: str) -> dict[str, Any]:
    return response_body(result, model, request.response_fields)


def _output(completion: dict, status: str) -> list[dict[str, Any]]:
    """The output items: a reasoning model's reasoning item first (OpenAI's shape: the reasoning as its
    `content`, no summary), then the message; a model cut inside its reasoning has no message."""
    text = completion.get("content", completion["text"])
    items = []
    if completion.get("reasoning") is not None:
        reasoning = [{"type": "reasoning_text", "text": completion["reasoning"]}]
        items.append({"type": "reasoning", "id": random_id("rs_"), "summary": [], "content": reasoning})
    if text is not None:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        message = {"type": "message", "id": random_id("msg_"), "status": status, "role": "assistant"}
        items.append({**message, "content": [part]})
    return items


def _usage(result: dict) -> dict[str, Any]:
    prompt, output = result["prompt_tokens"], result["completion_tokens"]
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": result.get("cached_tokens", 0), "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": result.get("reasoning_tokens", 0)},
        "total_tokens": prompt + output,
    }


def output_text(body: dict[str, Any]) -> str:
    """A Response's text, as the openai package's `Response.output_text` joins it."""
    return "".join(
        part["text"]
        for item in body["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


ENDPOINT = Endpoint(RESPONSES, "body.input", {"input": "x"}, parse=responses_request, answer=answer)
