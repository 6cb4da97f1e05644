"""Served models: names clients put in `body.model`, mapped to a local folder or an object-store URL
(adapters: bulkgen.models.loras)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "bulkgen-tiny"
EVERY_MODEL = "*"  # the key of `--tensor-parallel N`: the rank count of every model not named
BUNDLED_MODEL = Path(__file__).resolve().parent / "bundled"  # package data: ships in the wheel


def default_model_path() -> str:
    """The bundled model, trained by jobs/train_tiny.py (override with BULKGEN_DEFAULT_MODEL)."""
    return os.environ.get("BULKGEN_DEFAULT_MODEL", str(BUNDLED_MODEL))


def parse_model_specs(specs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`NAME=PATH` pairs (or a bare PATH, named after its folder); none means the bundled model."""
    if not specs:
        return {DEFAULT_MODEL_NAME: default_model_path()}
    models: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec.rstrip("/")).name, spec
        if not name or not path:
            raise ValueError(f"--model {spec!r}: expected NAME=PATH")
        if name in models:
            raise ValueError(f"--model {spec!r}: the name {name!r} is given twice")
        models[name] = path
    return models


def parse_tensor_parallel(specs: tuple[str, ...] | list[str]) -> dict[str, int]:
    """`--tensor-parallel` values: `N` (every model) or `NAME=N` (the served model NAME), repeatable, to
    model name (EVERY_MODEL for `N`) -> ranks; ValueError naming the flag and the bad value. Whether each
    NAME is served is the settings' check (`Settings`), where the models are known."""
    return _per_model("--tensor-parallel", specs, _rank_count, "N or NAME=N, e.g. big=2")


def parse_reasoning_parsers(specs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`--reasoning-parser` values: `PARSER` (every model) or `NAME=PARSER`, as parse_tensor_parallel reads
    its own; a PARSER is one of REASONING_PARSERS."""
    return _per_model("--reasoning-parser", specs, _reasoning_parser, "PARSER or NAME=PARSER, e.g. r1=think")


def parse_tool_parsers(specs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`--tool-parser` values: `FORMAT` (every model) or `NAME=FORMAT`; a FORMAT is one of TOOL_PARSERS."""
    return _per_model("--tool-parser", specs, _tool_parser, "FORMAT or NAME=FORMAT, e.g. coder=qwen3_coder")


def parse_template_options(specs: tuple[str, ...] | list[str]) -> dict[str, dict]:
    """`--chat-template-kwargs` values: `JSON` (every model) or `NAME=JSON`, a JSON object each (its text may
    hold '=' itself, so a value that starts with '{' names no model)."""
    return _per_model("--chat-template-kwargs", specs, _json_object, "JSON or NAME=JSON", named=_named_json)


def parse_thinking_budgets(specs: tuple[str, ...] | list[str]) -> dict[str, int]:
    """`--thinking-token-budget` values: `N` (every model) or `NAME=N`, as parse_tensor_parallel reads its own;
    N a non-negative integer (a line's own thinking_token_budget wins)."""
    return _per_model("--thinking-token-budget", specs, _budget, "N or NAME=N, e.g. r1=512")


def _budget(value: str) -> int:
    if not value.isdigit():
        raise ValueError("the budget must be a whole number of tokens, 0 or more")
    return int(value)


REASONING_PARSERS = ("auto", "think", "harmony", "none")  # auto: what the chat template teaches
# auto: the format the chat template teaches (bulkgen.batch.tools.FORMATS); none: calls stay content
TOOL_PARSERS = (
    "auto",
    "hermes",
    "llama3",
    "mistral",
    "qwen3_coder",
    "glm45",
    "minimax_m2",
    "kimi_k2",
    "deepseek_v3",
    "deepseek_v31",
    "pythonic",
    "harmony",
    "none",
)


def _json_object(value: str) -> dict:
    try:
        options = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(options, dict):
        raise ValueError('expected a JSON object of the template\'s options, e.g. {"enable_thinking": false}')
    return options


def _named_json(spec: str) -> tuple[str, str, str]:
    return ("", "", spec) if spec.lstrip().startswith("{") else spec.partition("=")


def _rank_count(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ValueError("the rank count must be a whole number of at least 1")
    return int(value)


def _reasoning_parser(value: str) -> str:
    if value not in REASONING_PARSERS:
        raise ValueError(f"the parser must be one of {', '.join(REASONING_PARSERS)}")
    return value


def _tool_parser(value: str) -> str:
    if value not in TOOL_PARSERS:
        raise ValueError(f"the format must be one of {', '.join(TOOL_PARSERS)}")
    return value


def _per_model(flag: str, specs, read, shape: str, named=lambda spec: spec.rpartition("=")) -> dict:
    """A per-model flag's values: model name (EVERY_MODEL for a bare value) -> `read(value)`; `named` splits
    a value into (name, "=" or "", value)."""
    values: dict = {}
    for spec in specs:
        name, sep, value = named(str(spec))
        name = name.strip() if sep else EVERY_MODEL
        try:
            if sep and not name:
                raise ValueError(f"expected {shape}")
            if name in values:
                raise ValueError(f"{'every model' if name == EVERY_MODEL else repr(name)} is given twice")
            values[name] = read(value.strip())
        except ValueError as exc:
            raise ValueError(f"{flag} {str(spec)[:80]!r}: {exc}") from None
    return values


def resolve_model_path(path: str, cache_dir: str | None = None, endpoint_url: str | None = None) -> str:
    """A local folder as is; `s3://…` or `file://…` copied once into a local cache, never from a hub."""
    return fetch_folder(path, "config.json", "model", cache_dir, endpoint_url)


def model_cache_folder(path: str, cache_dir: str | None = None) -> Path:
    """Where this node keeps its copy of the object-store folder `path` (BULKGEN_MODEL_CACHE)."""
    cache = Path(
        cache_dir or os.environ.get("BULKGEN_MODEL_CACHE", Path.home() / ".cache" / "bulkgen" / "models")
    )
    return cache / hashlib.sha256(path.encode()).hexdigest()[:16]


def fetch_folder(
    path: str, marker: str, what: str, cache_dir: str | None = None, endpoint_url: str | None = None
) -> str:
    """A model or adapter folder (`marker` is the file it must hold) as a local path: a local folder as
    is, an object-store URL copied once into this node's cache (BULKGEN_MODEL_CACHE)."""
    if "://" not in path or path.startswith("file://"):
        local = Path(path.removeprefix("file://"))
        if not (local / marker).is_file():
            raise FileNotFoundError(f"{what} folder {local} has no {marker}")
        return str(local)
    from bulkgen.store import open_store

    dest = model_cache_folder(path, cache_dir)
    if not (dest / marker).is_file():
        open_store(path, endpoint_url=endpoint_url).download_dir("", dest)
    if not (dest / marker).is_file():
        raise FileNotFoundError(f"{what} at {path} has no {marker}")
    return str(dest)
