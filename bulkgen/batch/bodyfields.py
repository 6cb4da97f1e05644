"""The body field rules the endpoints share: the sampling fields chat and completions both honour, and what
bulkgen does with each field it does not run (accepted and ignored, or refused with a 400). Each endpoint's
own list of fields (OpenAI's create params) is in its module, bulkgen.batch.endpoints.

`null` means "the default" for every field. The README's "Supported request fields" table mirrors these sets.
"""

from __future__ import annotations

from typing import Any

from bulkgen.batch.schema import quote

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"

# Honoured: these change what the model generates (bulkgen.batch.sampling, bulkgen.batch.messages).
HONOURED_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "seed",
    "stop",
    "logprobs",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "stream",
}
# Accepted and ignored: a hint about the hosted service (billing, caching, retention, latency) that does not
# change the result of a self-hosted run. Each is still type-checked, so a typo is told, not swallowed.
IGNORED = {
    "store": bool,
    "metadata": dict,
    "service_tier": str,
    "safety_identifier": str,
    "prompt_cache_key": str,
    "prompt_cache_retention": str,
    "prompt_cache_options": dict,
    "user": str,
    "stream_options": dict,
    "prediction": dict,
    "verbosity": str,
    "parallel_tool_calls": bool,
}
RESPONSES = "/v1/responses"


class LineError(ValueError):
    """A request line the service refuses: `code` and `param` follow OpenAI's batch error entries."""

    endpoint: str | None = None  # the endpoint a file's first line named, where the line fails all the same

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def unsupported(name: str, why: str) -> LineError:
    return LineError("unsupported_parameter", f"body.{name} {why}", f"body.{name}")


def invalid(name: str, rule: str, value: Any) -> LineError:
    return LineError("invalid_parameter", f"body.{name} {rule}; got {quote(value)}", f"body.{name}")


def check_refused(body: dict, endpoint: str) -> None:
    """Features a text-only self-hosted model cannot honour: refused by name, never silently dropped."""
    if body.get("stream") is not None and body["stream"] is not False:
        if body["stream"] is True:
            raise LineError("invalid_request", "streaming is not supported in batches", "body.stream")
        raise invalid("stream", "must be a boolean", body["stream"])
    if body.get("suffix") not in (None, ""):
        raise unsupported("suffix", "needs fill-in-the-middle, which this model does not do")
    for name in ("audio", "web_search_options", "moderation"):
        if body.get(name) is not None:
            raise unsupported(name, "is not available on a self-hosted text model")
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list) or any(m != "text" for m in modalities)):
        raise unsupported("modalities", f"may only be ['text'] (text output); got {quote(modalities)}")
    for name in ("tool_choice", "function_call"):
        choice = body.get(name)
        if choice is None or choice in ("none", "auto", "required") or allowed_tools(choice) is not None:
            continue
        if isinstance(choice, dict) and (choice.get("type") == "function" or name == "function_call"):
            continue  # a named function: bulkgen.batch.structured forces it
        raise unsupported(
            name, "supports 'none', 'auto', 'required', a named function and allowed_tools in mode 'auto'"
        )


def allowed_tools(choice) -> list[str] | None:
    """The function names of a tool_choice {"type": "allowed_tools", "allowed_tools": {"mode": "auto", ...}}
    (the model may call those, or none); None for any other choice."""
    allowed = (
        choice.get("allowed_tools")
        if isinstance(choice, dict) and choice.get("type") == "allowed_tools"
        else None
    )
    if (
        not isinstance(allowed, dict)
        or allowed.get("mode") != "auto"
        or not isinstance(allowed.get("tools"), list)
    ):
        return None
    names = [
        t.get("function", {}).get("name")
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
        else None
        for t in allowed["tools"]
    ]
    return names if all(isinstance(n, str) for n in names) else None


def check_ignored(body: dict) -> None:
    for name, kind in IGNORED.items():
        value = body.get(name)
        if value is not None and (
            not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))
        ):
            raise invalid(name, f"must be {'an object' if kind is dict else kind.__name__} (or null)", value)
