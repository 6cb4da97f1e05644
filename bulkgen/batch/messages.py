"""Chat messages, tool definitions and template options of a request body, in the shape transformers'
`apply_chat_template` takes them, so a conversation with tool calls replays through the model's own template.

Roles: system, developer (as system), user, assistant (with `refusal`, `tool_calls`, `function_call`), tool
and function. Content is a string or text parts, and a user message's may hold image parts
(bulkgen.batch.images: the request keeps their references, the message a `{"type": "image"}` placeholder
each); audio and file parts are refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bulkgen.batch.bodyfields import LineError, allowed_tools, invalid
from bulkgen.batch.images import ImageRef, image_ref
from bulkgen.batch.schema import quote

_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "function",
}
_MEDIA_PARTS = {"image_url", "input_audio", "file"}
_IMAGE_KINDS = {"image_url", "input_image"}
_IMAGE_PART_KEYS = {"type", "image_url", "prompt_cache_breakpoint"}  # the breakpoint: a hosted caching hint
_PLAIN = frozenset({"role", "content", "name"})
# The fields of each role's message in OpenAI's spec; any other is refused by name, as the hosted API does
# (dropping it would run a request other than the one written).
_FIELDS = {
    "system": _PLAIN,
    "developer": _PLAIN,
    "user": _PLAIN,
    "assistant": _PLAIN | {"refusal", "tool_calls", "function_call", "audio"},
    "tool": frozenset({"role", "content", "tool_call_id"}),
    "function": _PLAIN,
}


def messages(value: Any, images: list[ImageRef]) -> list[dict[str, Any]]:
    """The chat messages; the references of user messages' image parts are appended to `images`."""
    if not isinstance(value, list) or not value:
        raise LineError("invalid_messages", "body.messages must be a non-empty list", "body.messages")
    return [_message(m, f"body.messages[{i}]", images) for i, m in enumerate(value)]


def _message(message: Any, param: str, images: list[ImageRef]) -> dict[str, Any]:
    role = message.get("role") if isinstance(message, dict) else None
    if not isinstance(role, str) or role not in _ROLES:
        raise LineError("invalid_messages", f"{param}.role must be one of {sorted(_ROLES)}", param)
    _check_fields(message, role, param)
    out: dict[str, Any] = {
        "role": _ROLES[role],
        "content": _content(message.get("content"), param, role, images),
    }
    name = message.get("name")
    if name is not None:
        out["name"] = _string(name, f"{param}.name")
    if role == "assistant":
        _assistant(message, out, param)
    elif role == "tool":
        out["tool_call_id"] = _string(message.get("tool_call_id"), f"{param}.tool_call_id")
    elif role == "function" and name is None:
        raise LineError(
            "invalid_messages", f"{param}.name is required for a function message", f"{param}.name"
        )
    return out


def _check_fields(message: dict, role: str, param: str) -> None:
    unknown = [key for key in message if key not in _FIELDS[role]]
    if unknown:
        name = quote(unknown[0], 40).strip("'\"")
        raise LineError(
            "unknown_parameter",
            f"{param}.{name} is not a field of a {role} message ({', '.join(sorted(_FIELDS[role]))}); "
            "remove it",
            f"{param}.{unknown[0][:64]}",
        )
    if message.get("audio") is not None:
        raise LineError(
            "unsupported_parameter",
            f"{param}.audio refers to an earlier audio answer; this model is text-only",
            f"{param}.audio",
        )


def _assistant(message: dict, out: dict, param: str) -> None:
    """An assistant turn may carry tool calls instead of text, or a refusal (what it said, so kept as text)."""
    refusal = message.get("refusal")
    if refusal is not None:
        refusal = _string(refusal, f"{param}.refusal")
        out["content"] = out["content"] or refusal
    calls = message.get("tool_calls")
    if message.get("function_call") is not None:
        calls = [{"id": "call_0", "type": "function", "function": message["function_call"]}]
    if calls is not None:
        if not isinstance(calls, list):
            raise LineError("invalid_messages", f"{param}.tool_calls must be a list", f"{param}.tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{param}.tool_calls[{i}]") for i, c in enumerate(calls)]


def _tool_call(call: Any, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise LineError(
            "invalid_messages",
            f"{param} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}}}",
            param,
        )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:  # templates render arguments with `tojson`: hand them the object, not its JSON text
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


_CHAT_PARTS = {"text": "text", "refusal": "refusal"}  # part type -> its text key


@dataclass(frozen=True)
class ImageParts:
    """How a front door's content holds images: the part type, its reader, and the request's list of them."""

    kind: str  # image_url (chat), input_image (responses)
    read: Callable[[dict, str], ImageRef]  # (the part, its path) -> its reference
    found: list[ImageRef]  # the request's images, appended in order (ParsedRequest.images)


def _content(content: Any, param: str, role: str, images: list[ImageRef]) -> str | list[dict] | None:
    if content is None and role in ("assistant", "tool", "function"):
        return None
    found = ImageParts("image_url", _chat_image, images) if role == "user" else None
    return text_parts(content, param, _CHAT_PARTS, _MEDIA_PARTS, "invalid_messages", found)


def _chat_image(part: dict, where: str) -> ImageRef:
    """{"type": "image_url", "image_url": {"url": ..., "detail": ...}}; a file id or s3:// URL in `url`
    is bulkgen's (the hosted API takes http(s) and data: URLs there)."""
    spec, param = part.get("image_url"), f"{where}.image_url"
    unknown = sorted(set(spec) - {"url", "detail"}) if isinstance(spec, dict) else []
    if not isinstance(spec, dict) or unknown or not set(part) <= _IMAGE_PART_KEYS:
        raise LineError(
            "invalid_messages",
            f"{where} must be {{'type': 'image_url', 'image_url': {{'url': ..., 'detail': ...}}}}; "
            f"got {quote(part)}",
            param,
        )
    return image_ref(spec.get("url"), spec.get("detail"), param, f"{param}.detail")


def text_parts(
    content: Any,
    param: str,
    parts: dict[str, str],
    media: set[str],
    code: str,
    images: ImageParts | None = None,
) -> str | list[dict]:
    """A message's content as one string: a string, or a list of text parts (`parts`: part type -> the key
    holding its text) joined; with an image part (`images`, where the role may hold them), the list of
    text and `{"type": "image"}` parts the processor's template takes, each image's reference appended to
    `images.found`. Another media part (`media`) is refused by name; anything else is `code`, naming
    where. Shared by the chat and Responses front doors."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise LineError(
            code, f"{param}.content must be a string or a list of content parts", f"{param}.content"
        )
    out, with_images = [], False
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"{param}.content[{j}]"
        if images is not None and kind == images.kind:
            images.found.append(images.read(part, where))
            out.append({"type": "image"})
            with_images = True
            continue
        if kind in media:
            why = (
                "only user messages may hold images"
                if kind in _IMAGE_KINDS
                else "bulkgen takes text and images"
            )
            raise LineError(
                "unsupported_parameter",
                f"{where} is {'an' if kind[0] in 'aeiou' else 'a'} {kind} part; {why}",
                f"{where}.type",
            )
        text = part.get(parts[kind]) if kind in parts else None
        if not isinstance(text, str):
            raise LineError(
                code,
                f"{where} must be a text part, one of {sorted(parts)} with its text; got {quote(part)}",
                where,
            )
        out.append({"type": "text", "text": text})
    return out if with_images else "".join(p["text"] for p in out)


def content_text(content: str | list[dict] | None) -> str:
    """The text of a parsed message's content (its text parts, for one that holds images): what the
    estimates that run without the model's tokenizer or processor count."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return content or ""


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise LineError("invalid_messages", f"{param} must be a string; got {quote(value)}", param)
    return value


def chat_tools(body: dict) -> tuple[list[dict] | None, bool]:
    """-> (function tools for the template, whether they came as the legacy `functions`); none when the
    request says the model may not call them (tool_choice / function_call "none")."""
    tools, legacy = body.get("tools"), False
    if tools is None and body.get("functions") is not None:
        functions, legacy = body["functions"], True
        if not isinstance(functions, list):
            raise invalid("functions", "must be a list of function definitions", functions)
        tools = [{"type": "function", "function": f} for f in functions]
    if tools is None:
        return None, False
    name = "functions" if legacy else "tools"
    if not isinstance(tools, list):
        raise invalid(name, "must be a list of tools", tools)
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "custom":
            raise LineError(
                "unsupported_parameter",
                f"body.{name}[{i}] is a custom tool (free-form input needs "
                "constrained decoding); use a function tool",
                f"body.{name}[{i}].type",
            )
        function = tool.get("function") if kind == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"{name}[{i}]", "must be {'type': 'function', 'function': {'name': ...}}", tool)
    choice = body.get("tool_choice") or body.get("function_call")
    if choice == "none":
        return None, legacy
    names = allowed_tools(choice)
    if names is not None:  # allowed_tools, mode auto: the model sees (so may call) only those
        tools = [t for t in tools if t["function"]["name"] in names]
    return tools or None, legacy


# apply_chat_template's own arguments: a chat_template_kwargs entry of these names would change the call itself
_RENDER_ARGUMENTS = {
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


def template_kwargs(body: dict) -> dict[str, Any]:
    """Options the chat template takes: `chat_template_kwargs` (vLLM's field, e.g. Qwen3's enable_thinking;
    names the template does not know are passed and ignored by it, as vLLM does) and `reasoning_effort`."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs", "must be an object of the chat template's options", kwargs)
    taken = sorted(_RENDER_ARGUMENTS & kwargs.keys())
    if taken:
        raise LineError(
            "invalid_parameter",
            f"body.chat_template_kwargs.{taken[0]} is an argument of the template's rendering, not an option "
            "of the template; set it through the request's own fields",
            f"body.chat_template_kwargs.{taken[0]}",
        )
    effort = body.get("reasoning_effort")
    if effort is None:
        return dict(kwargs)
    if not isinstance(effort, str):
        raise invalid("reasoning_effort", "must be a string", effort)
    return {**kwargs, "reasoning_effort": effort}
