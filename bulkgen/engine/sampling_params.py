"""Per-request sampling settings, checked once at the edge so the hot loop can trust them."""

from __future__ import annotations

import math
from dataclasses import dataclass

GREEDY_TEMPERATURE = 1e-5  # smaller temperatures sample the argmax anyway, and near 1e-38 1/T overflows to NaN


@dataclass
class SamplingParams:
    """How one request is decoded. `temperature` below 1e-5 (0 included) means greedy; `n` completions share
    the prompt; `seed` makes sampling reproducible (completion i draws from the stream of (seed, i))."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check_sampling(self.__dict__)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


class SamplingError(ValueError):
    """A sampling value the engine cannot run; `field` names it (the request parser maps it to the body)."""

    def __init__(self, field: str, rule: str, value: object) -> None:
        super().__init__(f"SamplingParams.{field} {rule}, got {value!r}")
        self.field, self.rule, self.value = field, rule, value


def check_sampling(values: dict) -> None:
    """The engine's rules for the fields present in `values` (None means unset where a field may be unset).

    The one place these rules live: SamplingParams applies them, and the batch request parser calls this
    at validation, so validation lists exactly the problems the run would hit."""
    for name, minimum in (("max_tokens", 1), ("top_k", 0), ("n", 1)):
        if name in values:
            _check_int(name, values[name], minimum)
    for name, minimum, maximum in (("seed", 0, MAX_SEED), ("logprobs", 0, None)):
        if values.get(name) is not None:
            _check_int(name, values[name], minimum, maximum)
    if "temperature" in values:
        t = values["temperature"]
        if not _is_number(t) or not t >= 0:
            raise SamplingError("temperature", "must be a number >= 0", t)
    if "top_p" in values:
        p = values["top_p"]
        if not _is_number(p) or not 0 < p <= 1:
            raise SamplingError("top_p", "must be a number in (0, 1]", p)
    stop = values.get("stop")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise SamplingError("stop", "must be a list of non-empty strings", stop)
    ids = values.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(t) and t >= 0 for t in ids)):
        raise SamplingError("stop_token_ids", "must be non-negative ints", ids)


MAX_SEED = 2**64 - 1  # seeds travel to the workers as unsigned 64-bit ints


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bounds = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise SamplingError(name, f"must be an int {bounds}", value)
