"""`/v1/chat/completions` lines: a CreateChatCompletionRequest body in (messages, tools, structured outputs,
sampling), a `chat.completion` out (the assistant message, its reasoning, or the tool calls read from it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bulkgen.batch.bodyfields import CHAT, HONOURED_COMMON, LineError, check_ignored, check_refused
from bulkgen.batch.endpoints.base import Endpoint, choices_body
from bulkgen.batch.messages import chat_tools, messages, template_kwargs
from bulkgen.batch.reasoning import choice_fields
from bulkgen.batch.sampling import sampling
from bulkgen.batch.structured import REQUIRED, forced_calls, forced_param, forced_tool, response_guide
from bulkgen.batch.tools import call_of, parse_tool_calls

if TYPE_CHECKING:
    from bulkgen.batch.requests import ParsedRequest


def parse(body: dict[str, Any], request: ParsedRequest) -> ParsedRequest:
    check_refused(body, CHAT)
    check_ignored(body)
    request.messages = messages(body.get("messages"), request.images)
    request.tools, request.legacy_functions = chat_tools(body)
    request.template_kwargs = template_kwargs(body)
    request.forced_tool, guide = forced_tool(body, request.tools)
    if guide is not None and response_guide(body) is not None:
        raise LineError(
            "invalid_request",
            "body.response_format cannot constrain a forced tool call's output; drop one of them",
            "body.response_format",
        )
    request.guide_param = f"body.{forced_param(body)}" if guide is not None else "body.response_format"
    guide = guide or response_guide(body)
    request.sampling = sampling(body, logprobs_param="top_logprobs")
    if guide is not None:
        request.sampling["guide"] = guide
    if body.get("max_completion_tokens") is not None:
        request.limit_field = "max_completion_tokens"
    return request


def answer(request: ParsedRequest, result: dict, model: str) -> dict[str, Any]:
    return chat_body(
        result,
        model,
        request.tool_format,
        request.legacy_functions,
        request.forced_tool,
        request.tools,
        request.forced_syntax,
    )


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
    body = choices_body("chatcmpl-", "chat.completion", model, choices, result)
    return {**body, "system_fingerprint": result.get("system_fingerprint")}


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


# CreateChatCompletionRequest's fields (tests/service/spec_compat checks them against the spec)
_CHAT_ONLY = {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "modalities",
    "reasoning_effort",
    "audio",
    "web_search_options",
    "moderation",
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "prediction",
    "verbosity",
    "parallel_tool_calls",
}
FIELDS = frozenset(HONOURED_COMMON | _CHAT_ONLY | {"user", "stream_options"})
# vLLM's extensions (not OpenAI fields): sampling (bulkgen.batch.sampling), chat_template_kwargs
# (bulkgen.batch.messages), thinking_token_budget (bulkgen.batch.thinking_budget)
EXTENSIONS = frozenset(
    {"top_k", "min_p", "repetition_penalty", "chat_template_kwargs", "thinking_token_budget"}
)

ENDPOINT = Endpoint(
    CHAT,
    "body.messages",
    {"messages": [{"role": "user", "content": "x"}]},
    fields=FIELDS,
    parse=parse,
    answer=answer,
    extensions=EXTENSIONS,
)
