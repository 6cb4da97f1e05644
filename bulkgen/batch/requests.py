"""One input line -> a request the engine can run, with errors that name the line and field.

Validation and execution share this parser, so whatever passes validation is exactly what runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from bulkgen.batch.schema import quote
from bulkgen.engine.sampling_params import SamplingError, check_sampling

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Parameters we cannot honour: refusing them beats silently returning something else.
_UNSUPPORTED = {
    "tools": None, "functions": None, "tool_choice": None, "logit_bias": {}, "presence_penalty": 0,
    "frequency_penalty": 0, "echo": False, "suffix": None, "best_of": 1, "audio": None, "prediction": None,
}
# Every field a line may carry; anything else is refused by name (README: what cannot be honoured is refused).
_LINE_FIELDS = {"custom_id", "method", "url", "body"}
_COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "logprobs", "stream",
                  "user", *_UNSUPPORTED}
_BODY_FIELDS = {
    CHAT: _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "response_format"},
    COMPLETIONS: _COMMON_FIELDS | {"prompt"},
}
MAX_CUSTOM_ID = 64


class LineError(ValueError):
    """A request line the service refuses: `code` and `param` follow OpenAI's batch error entries."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass
class ParsedRequest:
    custom_id: str
    line: int
    model: str
    endpoint: str
    messages: list[dict[str, str]] | None = None
    prompt: str | list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams kwargs; max_tokens None = to context

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def parse_line(raw: bytes | str, line: int, endpoint: str) -> ParsedRequest:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise LineError("invalid_json_line", f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_json_line", f"the line must be a JSON object, got {type(obj).__name__}")
    _refuse_unknown(obj, _LINE_FIELDS, "")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id.strip():
        raise LineError("missing_custom_id", "custom_id must be a non-empty string", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID:
        raise LineError("invalid_custom_id", f"custom_id is {len(custom_id)} characters; at most {MAX_CUSTOM_ID} "
                        f"are allowed ({quote(custom_id, 40)})", "custom_id")
    if obj.get("method", "POST") != "POST":
        raise LineError("invalid_method", f"method must be POST, got {quote(obj.get('method'))}", "method")
    if obj.get("url") != endpoint:
        raise LineError(
            "url_mismatch", f"url {quote(obj.get('url'))} does not match the batch endpoint {endpoint!r}", "url"
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", "body must be a JSON object", "body")
    _refuse_unknown(body, _BODY_FIELDS[endpoint], "body.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise LineError("missing_model", "body.model must be a non-empty string", "body.model")
    request = ParsedRequest(custom_id=custom_id, line=line, model=model, endpoint=endpoint)
    if endpoint == CHAT:
        request.messages = _messages(body.get("messages"))
    else:
        request.prompt = _prompt(body.get("prompt"))
    request.sampling = _sampling(body, endpoint)
    return request


def _refuse_unknown(obj: dict, known: set[str], prefix: str) -> None:
    unknown = [key for key in obj if key not in known]
    if unknown:
        names = ", ".join(prefix + quote(key, 40).strip("'\"") for key in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise LineError("unknown_parameter", f"unknown field{'s' if len(unknown) > 1 else ''} {names}{more}: "
                        "bulkgen refuses what it cannot honour; remove it", prefix + unknown[0][:64])


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise LineError("invalid_messages", "body.messages must be a non-empty list", "body.messages")
    out = []
    for i, message in enumerate(messages):
        param = f"body.messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLES:
            raise LineError("invalid_messages", f"{param}.role must be one of {sorted(_ROLES)}", param)
        out.append({"role": _ROLES[role], "content": _content(message.get("content"), param)})
    return out


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise LineError("invalid_messages", f"{param}.content must be a string or a list of text parts", param)


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return prompt
    raise LineError(
        "invalid_prompt",
        "body.prompt must be a non-empty string or list of token ids (one prompt per line)",
        "body.prompt",
    )


def _sampling(body: dict, endpoint: str) -> dict[str, Any]:
    """The API's own limits here, then the engine's rules (`check_sampling`, the ones the run applies)."""
    if body.get("stream"):
        raise LineError("invalid_request", "streaming is not supported in batches", "body.stream")
    for name, neutral in _UNSUPPORTED.items():
        if body.get(name, neutral) not in (neutral, None):
            raise LineError("unsupported_parameter", f"body.{name} is not supported", f"body.{name}")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise LineError("unsupported_parameter", "only response_format type 'text' is supported",
                        "body.response_format")
    names = {"max_tokens": "max_completion_tokens" if body.get("max_completion_tokens") is not None
             else "max_tokens", "logprobs": "top_logprobs" if endpoint == CHAT else "logprobs"}
    out = {
        "max_tokens": _number(body.get(names["max_tokens"]), names["max_tokens"], int, None, None),
        "temperature": _number(body.get("temperature", 1.0), "temperature", float, 0.0, 2.0),
        "top_p": _number(body.get("top_p", 1.0), "top_p", float, None, None),
        "n": _number(body.get("n", 1), "n", int, None, 16),
        "seed": _number(body.get("seed"), "seed", int, None, None),
        "stop": _stop(body.get("stop")),
    }
    out["logprobs"] = _logprobs(body, endpoint)
    try:
        check_sampling({k: v for k, v in out.items() if v is not None})
    except SamplingError as err:
        param = f"body.{names.get(err.field, err.field)}"
        raise LineError("invalid_parameter", f"{param} {err.rule}; got {quote(body.get(param[5:]))}", param) from None
    out["temperature"], out["top_p"] = float(out["temperature"]), float(out["top_p"])  # in range: checked
    return out


def _number(value: Any, name: str, kind: type, low: float | None, high: float | None):
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok or (low is not None and value < low) or (high is not None and value > high):
        bounds = f" between {low} and {high}" if low is not None and high is not None else (
            f" >= {low}" if low is not None else (f" <= {high}" if high is not None else ""))
        raise LineError("invalid_parameter", f"body.{name} must be {kind.__name__}{bounds}; got {quote(value)}",
                        f"body.{name}")
    return value


def _stop(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise LineError("invalid_parameter", "body.stop must be a string or up to 4 strings", "body.stop")
    return stops


def _logprobs(body: dict, endpoint: str) -> int | None:
    if endpoint == COMPLETIONS:
        return _number(body.get("logprobs"), "logprobs", int, 0, 20)
    top = _number(body.get("top_logprobs"), "top_logprobs", int, 0, 20)
    if body.get("logprobs"):
        return top or 0
    if top is not None:
        raise LineError("invalid_parameter", "body.top_logprobs needs logprobs: true", "body.top_logprobs")
    return None


_ALIASES = {"max_tokens": ("max_tokens", "max_completion_tokens"),
            "max_completion_tokens": ("max_tokens", "max_completion_tokens")}


def fill_defaults(raw: bytes, body_defaults: dict[str, Any], url: str | None = None) -> bytes:
    """The line with `body_defaults` set in its body where it sets none (max_tokens and
    max_completion_tokens count as one), and `url` where it has none. A line that is not a JSON object
    with an object body is returned as it is, so validation refuses it as written, on the same line."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return raw
    if not isinstance(obj, dict):
        return raw
    if url is not None and "url" not in obj:
        obj["url"] = url
    body = obj.get("body")
    if isinstance(body, dict):
        for name, value in body_defaults.items():
            if all(body.get(alias) is None for alias in _ALIASES.get(name, (name,))):
                body[name] = value
    return json.dumps(obj, ensure_ascii=False).encode()
