"""Per-request sampling settings, checked once at the edge so the hot loop can trust them."""

from __future__ import annotations

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
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("top_k", self.top_k, minimum=0)
        _check_int("n", self.n, minimum=1)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0)
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ValueError(f"SamplingParams.temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"SamplingParams.stop must be a list of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None:
            if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
                raise ValueError(
                    f"SamplingParams.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _check_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"SamplingParams.{name} must be an int >= {minimum}, got {value!r}")
