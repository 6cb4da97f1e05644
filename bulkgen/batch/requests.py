"""One input line -> a request the engine can run, with errors that name the line and field.

`RequestLine` is the batch file's line format, written once (vLLM's `BatchRequestInput` is the model):
every reader of an input line goes through it. A line has two halves, checked apart because they fail
differently:
- the line itself (`RequestLine.read`: a JSON object with custom_id, method, url, a body object naming the
  model). What is wrong there is wrong with the FILE: validation fails the batch, listing every line.
- its body (`RequestLine.request`: messages or prompt, sampling, tools, parsed as `url` says). What is
  wrong there is wrong with that ONE request: it becomes that line's 400 in the error file (`param` is
  `body.<field>`), and the rest runs.
Validation and execution share this parser, so whatever passes validation is exactly what runs.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from bulkgen.batch.bodyfields import CHAT, COMPLETIONS, RESPONSES, LineError
from bulkgen.batch.endpoints import ENDPOINTS
from bulkgen.batch.images import ImageRef
from bulkgen.batch.nesting import MAX_NESTING, holds_marker, load
from bulkgen.batch.schema import check_endpoint, quote, versioned
from bulkgen.batch.thinking_budget import thinking_budget

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "LineError",
    "ParsedRequest",
    "RequestLine",
    "custom_id_of",
    "url_of",
    "parse_line",
    "Fill",
    "NotABatchFile",
    "pick_adapter",
    "RESPONSES",
]

# Every field a line may carry; anything else makes the line (so the file) invalid.
_LINE_FIELDS = {"custom_id", "method", "url", "body"}
# OpenAI sets no length on custom_id (64 characters is Anthropic's rule); ids built from paths, URLs or
# document ids run long. This bound only keeps a line's id from being a megabyte of text: nothing stores or
# indexes it by length (validation keeps a digest per id, result files carry it as it came).
MAX_CUSTOM_ID_BYTES = 1024


@dataclass(frozen=True)
class RequestLine:
    """One line of a batch input file: the Batch API's request input object."""

    custom_id: str  # the client's name for the request: 1 to MAX_CUSTOM_ID_BYTES bytes of UTF-8, unique in
    # the file (validation checks that across lines); the request's output or error line carries it back
    method: str  # the HTTP method of the request: POST, the only one the Batch API takes
    url: str  # the endpoint the body is for; it picks the body's parser, and must be the batch's
    body: dict[str, Any]  # the request body as `url` takes it; read checks only that it names a model
    line: int  # the line's number in its file (from 1): every error about it names it
    too_deep: str | None = None  # the body field that nests deeper than MAX_NESTING (cut out of `body`
    # as the line was read): `request` refuses the line for it
    stored: bytes | None = None  # the line with a Fill's defaults written in, as its file stores it (None:
    # the line as it came)

    @property
    def model(self) -> str:
        return self.body["model"]

    @classmethod
    def read(cls, raw: bytes | str, line: int, endpoint: str | None, fill: Fill | None = None) -> RequestLine:
        """The line of a batch whose endpoint is `endpoint`, with `fill`'s defaults set where it sets none
        (`stored` then holds it as filled); LineError says what makes it (so its file) invalid.
        `endpoint` None: the line's own url decides it (the first line of a file that names no endpoint;
        NotABatchFile where it cannot)."""
        try:
            obj, cut = load(raw)
        except ValueError as exc:  # UnicodeDecodeError included
            if endpoint is None:
                raise NotABatchFile(line) from None
            raise LineError("invalid_json_line", f"not valid JSON: {exc}") from None
        if not isinstance(obj, dict):
            if endpoint is None:
                raise NotABatchFile(line)
            raise LineError("invalid_json_line", f"the line must be a JSON object, got {type(obj).__name__}")
        stored = None
        if fill is not None and not cut and fill.apply(obj):
            stored = json.dumps(obj, ensure_ascii=False).encode()
        if endpoint is None:
            if not isinstance(obj.get("url"), str):
                raise NotABatchFile(line, "no 'url' field, and no endpoint is given (--endpoint)")
            endpoint = check_endpoint(versioned(obj["url"]))  # InvalidRequest: no batch endpoint
        try:
            return cls._check(obj, cut, line, endpoint, stored)
        except LineError as err:
            err.endpoint = endpoint
            raise

    @classmethod
    def _check(cls, obj: dict, cut: bool, line: int, endpoint: str, stored: bytes | None) -> RequestLine:
        _refuse_unknown(obj, _LINE_FIELDS, "")
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id.strip():
            raise LineError("missing_custom_id", "custom_id must be a non-empty string", "custom_id")
        size = len(custom_id.encode("utf-8", "surrogatepass"))
        if size > MAX_CUSTOM_ID_BYTES:
            raise LineError(
                "invalid_custom_id",
                f"custom_id is {size} bytes of UTF-8; at most {MAX_CUSTOM_ID_BYTES} are allowed "
                f"({quote(custom_id, 40)})",
                "custom_id",
            )
        method = obj.get("method", "POST")
        if method != "POST":
            raise LineError("invalid_method", f"method must be POST, got {quote(method)}", "method")
        if versioned(obj.get("url")) != endpoint:
            raise LineError(
                "url_mismatch",
                f"url {quote(obj.get('url'))} does not match the batch endpoint {endpoint!r}",
                "url",
            )
        body = obj.get("body")
        if not isinstance(body, dict):
            raise LineError("invalid_body", "body must be a JSON object", "body")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise LineError("missing_model", "body.model must be a non-empty string", "body.model")
        return cls(custom_id, method, endpoint, body, line, _too_deep(body) if cut else None, stored)

    def request(self) -> ParsedRequest:
        """The body as the engine runs it, parsed as its `url` says; LineError refuses this request alone."""
        if self.too_deep is not None:
            name = "body." + quote(self.too_deep, 40).strip("'\"")
            raise LineError(
                "invalid_parameter",
                f"{name} nests arrays and objects deeper than {MAX_NESTING} levels (counting from the line)",
                f"body.{self.too_deep[:64]}",
            )
        return _parse_body(self)

    def placeholder(self) -> ParsedRequest:
        """A refused body's stand-in in the line index: no work, so its range is cut and its worker
        refuses it."""
        return ParsedRequest(
            self.custom_id, self.line, self.model, self.url, prompt="", sampling={"max_tokens": 0}
        )


@dataclass
class ParsedRequest:
    """A request as the worker runs it and the response writer answers it (bulkgen.batch.outputlines)."""

    custom_id: str
    line: int
    model: str
    endpoint: str
    messages: list[dict[str, Any]] | None = (
        None  # as the chat template takes them (role, content, name, ...);
    )
    # a content that holds images is a list of {"type": "text", "text"} and {"type": "image"} parts
    images: list[ImageRef] = field(default_factory=list)  # the image parts' references, in order
    # (bulkgen.batch.images.load_images reads them in the worker)
    prompt: str | list[int] | None = None  # the (first) prompt
    prompts: list[str | list[int]] | None = None  # every prompt, when the line holds several: choices of
    # prompt i get the indices i*n .. i*n+n-1
    sampling: dict[str, Any] = field(
        default_factory=dict
    )  # SamplingParams kwargs; max_tokens None = to context
    tools: list[dict] | None = None  # function tools, rendered through the chat template
    legacy_functions: bool = False  # `functions` (not `tools`): answer with message.function_call
    template_kwargs: dict[str, Any] = field(
        default_factory=dict
    )  # e.g. reasoning_effort, where the template takes it
    echo: bool = False  # completions: the prompt leads the text (and its logprobs)
    tool_format: str | None = None  # set by prepare.tokenize from the chat template: parse calls
    reasoning_parser: str | None = None  # how to read reasoning out of the output (bulkgen.batch.reasoning):
    # the model's --reasoning-parser (set by the worker), else what prepare.render_chat reads in the template
    thinking_budget: int | None = None  # body.thinking_token_budget (bulkgen.batch.thinking_budget)
    reasoning_open: bool = False  # the rendered prompt left `<think>` open: the output starts in reasoning
    forced_tool: str | None = None  # a forced call: "*" (tool_choice required) or the function's
    # name; its grammar is sampling["guide"]
    forced_syntax: bool = False  # set by prepare: the forced call is written in tool_format's own syntax
    # (bulkgen.batch.forced_syntax), not as a JSON document
    guide_param: str | None = None  # the body field sampling["guide"] came from: a grammar that fails as
    # the request runs is that line's 400 naming it
    limit_field: str = "max_tokens"  # the body field max_tokens came from (errors name it)
    response_fields: dict[str, Any] | None = None  # /v1/responses: the request fields its Response repeats
    embedding: dict[str, Any] | None = None  # /v1/embeddings: encoding_format, dimensions (its endpoint)
    lora: str | None = None  # the LoRA adapter `model` picks (pick_adapter); None: the base model itself


def parse_line(raw: bytes | str, line: int, endpoint: str, fill: Fill | None = None) -> ParsedRequest:
    """Both halves: the request as the worker runs it (any LineError refuses the line)."""
    return RequestLine.read(raw, line, endpoint, fill).request()


def pick_adapter(model: str, base: str, adapters: Collection[str]) -> str | None:
    """The adapter a line's `body.model` picks in a batch of the served model `base` (None: the base
    itself), given the base's adapters. Any other name (an unknown adapter, another base's adapter) is
    that line's 400: one batch mixes the base and its adapters, and one typo never fails the rest."""
    if model == base:
        return None
    if model in adapters:
        return model
    known = ", ".join(sorted(adapters)[:20]) or "none"
    raise LineError(
        "model_not_found",
        f"body.model {quote(model)} is neither the batch's model {base!r} nor one of its adapters ({known})",
        "body.model",
    )


def custom_id_of(raw: bytes | str) -> str:
    """The custom_id of a line, nothing else checked: of an input line validation passed, or of a result
    line (the same field of the output and error files); "" where the line names none."""
    try:
        obj, _ = load(raw)
    except ValueError:
        return ""
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    return custom_id if isinstance(custom_id, str) else ""


def url_of(raw: bytes | str) -> str | None:
    """The `url` of a line in its '/v1/' form, to tell a file's endpoint from its first line (None where it
    names none); LineError("invalid_json_line") where the line is not a JSON object."""
    try:
        obj, _ = load(raw)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise LineError("invalid_json_line", "not a JSON object")
    url = versioned(obj.get("url"))
    return url if isinstance(url, str) else None


def _too_deep(body: dict[str, Any]) -> str:
    """The body field that held a value cut out for its nesting (LineError if none did: the cut was
    elsewhere in the line, which its own checks did not refuse)."""
    for key, value in body.items():
        if holds_marker(value):
            return key
    raise LineError(
        "invalid_json_line", f"the line nests arrays and objects deeper than {MAX_NESTING} levels"
    )


def _parse_body(line: RequestLine) -> ParsedRequest:
    body, endpoint = line.body, line.url
    handler = ENDPOINTS[endpoint]
    _refuse_unknown(body, handler.fields | handler.extensions, "body.")
    request = ParsedRequest(line.custom_id, line.line, line.model, endpoint)
    request.thinking_budget = thinking_budget(body)
    return handler.parse(body, request)


def _refuse_unknown(obj: dict, known: set[str] | frozenset[str], prefix: str) -> None:
    unknown = [key for key in obj if key not in known]
    if unknown:
        names = ", ".join(prefix + quote(key, 40).strip("'\"") for key in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise LineError(
            "unknown_parameter",
            f"unknown field{'s' if len(unknown) > 1 else ''} {names}{more}: "
            "not a field of the OpenAI request; remove it",
            prefix + unknown[0][:64],
        )


_ALIASES = {
    "max_tokens": ("max_tokens", "max_completion_tokens"),
    "max_completion_tokens": ("max_tokens", "max_completion_tokens"),
}


@dataclass(frozen=True)
class Fill:
    """A watcher job's defaults: `body` fields set in each request body where the line sets none
    (max_tokens and max_completion_tokens count as one), and `url` where the line has none. They are set
    in the line's one parse (`RequestLine.read`), which gives the line as its file then stores it: what
    ran is what the batch's input file holds."""

    body: Mapping[str, Any] = field(default_factory=dict)
    url: str | None = None

    def apply(self, obj: dict[str, Any]) -> bool:
        """Set the defaults in a parsed line; -> whether any was missing. A body that is no object is left
        as it is, so validation refuses the line as written."""
        changed = False
        if self.url is not None and "url" not in obj:
            obj["url"], changed = self.url, True
        body = obj.get("body")
        if isinstance(body, dict):
            for name, value in self.body.items():
                if all(body.get(alias) is None for alias in _ALIASES.get(name, (name,))):
                    body[name], changed = value, True
        return changed


class NotABatchFile(ValueError):
    """A file whose first request line is no JSON object, or names no endpoint where none is given: no
    batch file at all, so no batch is made of it."""

    def __init__(self, line: int | None, reason: str = "not a JSON object: this is not a JSONL batch file"):
        super().__init__(reason if line is None else f"line {line}: {reason}")
        self.line, self.reason = line, reason

    def at(self, name: str) -> str:
        """The problem naming the file and line, as the CLI's errors do."""
        return f"{name}: {self.reason}" if self.line is None else f"{name}:{self.line}: {self.reason}"
