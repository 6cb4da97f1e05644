"""A request line made ready for the engine: chat template, tokenize, fit the context.

Runs inside the worker actors, which hold the model's real tokenizer and the engine's real context
limit (`Engine.max_model_len`, which already accounts for sliding windows): this is the one place
that decides whether a request fits, and the driver never needs the model at all. What only the model
can judge (does its template render tools? are logit_bias ids in its vocabulary?) is refused here, as
that line's 400.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from bulkgen.batch.endpoints import ENDPOINTS
from bulkgen.batch.reasoning import opens_reasoning, reasoning_parser
from bulkgen.batch.requests import LineError, ParsedRequest
from bulkgen.batch.special_tokens import special_tokens
from bulkgen.batch.thinking_budget import gate_reasoning
from bulkgen.batch.tools import forced_guide, tool_format


def split_prompts(request: ParsedRequest) -> list[ParsedRequest]:
    """A completions line with several prompts as one request per prompt (the worker merges their choices)."""
    if not request.prompts:
        return [request]
    return [replace(request, prompt=prompt, prompts=None) for prompt in request.prompts]


def tokenize(request: ParsedRequest, tokenizer) -> list[int]:
    if request.messages is not None:
        ids = tokenizer(render_chat(request, tokenizer), add_special_tokens=False)["input_ids"]
    elif isinstance(request.prompt, list):
        if max(request.prompt) >= len(tokenizer):
            where = _input(request)
            raise LineError(
                "invalid_prompt", f"a token id in {where} is outside the vocabulary ({len(tokenizer)})", where
            )
        ids = list(request.prompt)
    else:
        ids = tokenizer(request.prompt)["input_ids"]
    _check_vocabulary(request, len(tokenizer))
    if not ids:  # prompt "": generate from the start of a document, as the API's default prompt does
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ids = [start]
    return ids


def tokenize_with_images(request: ParsedRequest, processor, images: list) -> tuple[list[int], Any]:
    """A vision-language model's prompt: the chat rendered by the model's template (image parts stay
    `{"type": "image"}` placeholders, which the template writes as the model's image token) and tokenized by
    its processor, which expands each image into its placeholder tokens; with the images as the engine takes
    them (bulkgen.engine.features.multimodal.ImageInputs). A line without images takes the text path. CPU work for
    the worker's preparing threads: `images` are the decoded PIL images of the line's image parts, in order."""
    if not images:
        return tokenize(request, processor.tokenizer), None
    from bulkgen.engine.features.multimodal import process  # torch: only workers prepare image lines

    ids, inputs = process(processor, render_chat(request, processor.tokenizer), images)
    _check_vocabulary(request, len(processor.tokenizer))
    return ids, inputs


def render_chat(request: ParsedRequest, tokenizer) -> str:
    """The prompt text the model sees: messages, tools and template options through its own chat template.
    Sets `request.tool_format` (how to read calls back) when tools are rendered, and how to read reasoning
    back (`request.reasoning_parser`, `request.reasoning_open`)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise LineError(
            "model_not_chat", "this model has no chat template; use /v1/completions", _input(request)
        )
    if not isinstance(template, str):  # a dict of named templates: the default one renders chat
        template = template.get("tool_use") if request.tools else template.get("default", "")
    kwargs: dict[str, Any] = dict(request.template_kwargs)  # options it does not know, it ignores
    if request.tools:
        taught = tool_format(template)
        request.tool_format = request.tool_format or taught  # the model's --tool-parser wins
        if taught is None:
            name = "functions" if request.legacy_functions else "tools"
            raise LineError(
                "unsupported_parameter",
                f"this model's chat template does not render tools, so body.{name} would be silently dropped",
                f"body.{name}",
            )
        kwargs["tools"] = request.tools
        if request.forced_tool is not None:
            _force_in_syntax(request, tokenizer)
    try:
        try:
            prompt = tokenizer.apply_chat_template(
                request.messages, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except TypeError:  # a template that concatenates a call's arguments text (DeepSeek-V3.1) not tojson
            messages = _arguments_as_text(request.messages)
            if messages is request.messages:
                raise
            prompt = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **kwargs
            )
    except Exception as exc:  # the template's own checks (e.g. roles must alternate): this line's 400
        raise LineError(
            "invalid_messages",
            f"the model's chat template refused {_input(request)}: {type(exc).__name__}: {str(exc)[:200]}",
            _input(request),
        ) from None
    if request.reasoning_parser is None:  # no --reasoning-parser for the model: what its template teaches
        request.reasoning_parser = reasoning_parser(template, tokenizer)
    request.reasoning_open = opens_reasoning(prompt)
    gate_reasoning(
        request.sampling,
        request.reasoning_parser,
        request.reasoning_open,
        prompt,
        request.thinking_budget,
        tokenizer,
    )
    return prompt


def _force_in_syntax(request: ParsedRequest, tokenizer) -> None:
    """A forced call written in the template's own syntax where its format has a writer."""
    guide = forced_guide(request.tool_format, request.forced_tool, request.tools, special_tokens(tokenizer))
    if guide is not None:
        request.sampling["guide"], request.forced_syntax = guide, True


def _arguments_as_text(messages: list[dict]) -> list[dict]:
    """The messages with each replayed call's arguments as JSON text (bulkgen.batch.messages hands templates
    the object, which most render with `tojson`); the same list when no message has a call."""
    if not any(m.get("tool_calls") for m in messages):
        return messages
    return [
        {**m, "tool_calls": [_call_as_text(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
        for m in messages
    ]


def _call_as_text(call: dict) -> dict:
    arguments = call["function"]["arguments"]
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {**call, "function": {**call["function"], "arguments": text}}


def _input(request: ParsedRequest) -> str:
    """The body field the prompt came from, as errors name it."""
    return ENDPOINTS[request.endpoint].input_field


def _check_vocabulary(request: ParsedRequest, vocab: int) -> None:
    bias = request.sampling.get("logit_bias") or {}
    outside = [t for t in bias if t >= vocab]
    if outside:
        raise LineError(
            "invalid_parameter",
            f"body.logit_bias names token {outside[0]}, outside the vocabulary ({vocab} tokens)",
            "body.logit_bias",
        )


def fit_context(request: ParsedRequest, prompt_len: int, max_model_len: int) -> dict[str, Any]:
    """Resolve max_tokens (None: the rest of the context) and refuse what cannot fit, as the hosted API does."""
    fit = ENDPOINTS[request.endpoint].fit
    if fit is not None:  # not a generation (embeddings: prefill only)
        return fit(request, prompt_len, max_model_len)
    params = {k: v for k, v in request.sampling.items() if v is not None}
    budget = max_model_len - prompt_len
    asked = params.get("max_tokens")
    if budget < 1 or (asked is not None and asked > budget):
        raise _too_long(request, prompt_len, max_model_len, asked)
    params["max_tokens"] = budget if asked is None else asked
    return params


def _too_long(request: ParsedRequest, prompt_len: int, max_model_len: int, asked: int | None) -> LineError:
    """OpenAI's two wordings: with a token limit, the sum asked for; without one, the prompt alone (the
    completion would get whatever is left, and nothing is)."""
    where, what = _input(request), _input(request).removeprefix("body.")
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if asked is None:
        message = (
            f"{head}your {what} resulted in {prompt_len} tokens. Please reduce the length of the {what}."
        )
        return LineError("context_length_exceeded", message, where)
    if prompt_len < max_model_len:  # the prompt fits; the completion asked for is what does not
        where = f"body.{request.limit_field}"
    message = (
        f"{head}you requested {prompt_len + asked} tokens ({prompt_len} in the {what}, {asked} in the "
        f"completion). Please reduce the length of the {what} or completion."
    )
    return LineError("context_length_exceeded", message, where)
