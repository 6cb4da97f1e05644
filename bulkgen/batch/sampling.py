"""A request body's sampling fields -> SamplingParams kwargs, with the API's limits, then the engine's rules.

`null` is the default for every field. A penalty or bias at its neutral value is left out of the kwargs (the
engine's default is the same), so a request pays only for what it asks. temperature, top_p, top_k, min_p and
repetition_penalty are in the kwargs exactly when the line sets them: a field left out takes the model's
generation_config.json default in the worker (Engine.sampling_params), else OpenAI's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from bulkgen.batch.bodyfields import LineError, invalid
from bulkgen.engine.sampling.sampling_params import SamplingError, check_sampling

INT64 = 2**63
MAX_N = 128
MAX_BEST_OF = 128
MAX_LOGPROBS = 20
LIMIT_FIELDS = ("max_completion_tokens", "max_output_tokens")  # max_tokens by another name (chat, responses)


def sampling(
    body: dict,
    logprobs: Callable[[dict], int | None] | None = None,
    logprobs_param: str = "logprobs",
    more: Callable[[dict, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The API's own limits here, then the engine's rules (`check_sampling`, the ones the run applies).
    The endpoint's module says what differs: how it asks for `logprobs` (default `chat_logprobs`), the body
    field the engine's logprobs rule names, and `more` fields of its own (completions' `best_of`)."""
    limit = next((n for n in LIMIT_FIELDS if body.get(n) is not None), "max_tokens")
    out: dict[str, Any] = {
        "max_tokens": _int(body, limit, 0, None),
        "n": _int(body, "n", 1, MAX_N) or 1,
        "seed": _int(body, "seed", -INT64, INT64 - 1),
        "stop": _stop(body.get("stop")),
        "logprobs": (logprobs or chat_logprobs)(body),
    }
    for name, high in (("temperature", 2), ("top_p", 1)):
        if body.get(name) is not None:
            out[name] = float(_number(body, name, 0, high, 1.0))
    for name in ("presence_penalty", "frequency_penalty"):
        if value := _number(body, name, -2, 2, 0):
            out[name] = float(value)
    _extensions(body, out)
    if bias := _logit_bias(body.get("logit_bias")):
        out["logit_bias"] = bias
    if more is not None:
        more(body, out)
    names = {"max_tokens": limit, "logprobs": logprobs_param}
    try:
        check_sampling({k: v for k, v in out.items() if v is not None})
    except SamplingError as err:
        name = names.get(err.field, err.field)
        raise invalid(name, err.rule, body.get(name)) from None
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, low: int, high: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise invalid(name, f"must be an integer {_bounds(low, high)}", value)
    return value


def _number(body: dict, name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value)
    if not ok or not low <= value <= high:
        raise invalid(name, f"must be a number {_bounds(low, high)}", value)
    return value


def _bounds(low: float, high: float | None) -> str:
    return f"between {low} and {high}" if high is not None else f">= {low}"


def _stop(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "must be a string or a list of up to 4 strings", stop)
    return [s for s in stops if s] or None  # an empty stop string can never match: it is no stop


def completion_logprobs(body: dict) -> int | None:
    """Completions' `logprobs`: how many alternatives per token (0-20)."""
    return _int(body, "logprobs", 0, MAX_LOGPROBS)


def chat_logprobs(body: dict) -> int | None:
    """Chat's (and the Responses API's) `logprobs`: a flag, with the alternatives in `top_logprobs`."""
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    flag = body.get("logprobs")
    if flag is not None and not isinstance(flag, bool):
        raise invalid("logprobs", "must be a boolean", flag)
    if flag:
        return top or 0
    if top is not None:
        raise LineError("invalid_parameter", "body.top_logprobs needs logprobs: true", "body.top_logprobs")
    return None


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """{"token id": bias}: the keys are token ids written as strings (JSON keys), biases -100..100."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise invalid("logit_bias", "must be an object of token id -> bias", bias)
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 19):
            raise invalid("logit_bias", "keys must be token ids (non-negative integers as strings)", key)
        ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value) and -100 <= value <= 100
        if not ok:
            raise invalid("logit_bias", f"[{key}] must be a number between -100 and 100", value)
        out[int(key)] = float(value)
    return out or None


def _extensions(body: dict, out: dict[str, Any]) -> None:
    """vLLM's top_k (-1 or 0: off), min_p (0-1, 0: off) and repetition_penalty (> 0, 1: off); set even
    when off, so that the line's choice overrides the model's generation_config default."""
    if (top_k := _int(body, "top_k", -1, None)) is not None:
        out["top_k"] = max(top_k, 0)
    if body.get("min_p") is not None:
        out["min_p"] = float(_number(body, "min_p", 0, 1, 0))
    penalty = body.get("repetition_penalty")
    if penalty is None:
        return
    if not ((_is_int(penalty) or isinstance(penalty, float)) and math.isfinite(penalty) and penalty > 0):
        raise invalid("repetition_penalty", "must be a number > 0 (1: off)", penalty)
    out["repetition_penalty"] = float(penalty)


def best_of(body: dict, out: dict[str, Any]) -> None:
    """Completions' `best_of` (and `echo`'s prompt logprobs)."""
    best_of = _int(body, "best_of", 0, MAX_BEST_OF)
    if best_of is not None and best_of < out["n"]:
        raise invalid("best_of", f"must be >= n ({out['n']})", best_of)
    if best_of is not None and best_of > out["n"]:
        out["best_of"] = best_of
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise invalid("echo", "must be a boolean", echo)
    if echo and out["logprobs"] is not None:
        out["prompt_logprobs"] = out["logprobs"]
