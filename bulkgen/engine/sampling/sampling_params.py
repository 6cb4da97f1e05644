"""Per-request sampling settings, checked once at the edge so the hot loop can trust them."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bulkgen.engine.features.guide import GrammarError, Guide, check
from bulkgen.engine.features.reasoning_gate import ReasoningSpec

GREEDY_TEMPERATURE = (
    1e-5  # smaller temperatures sample the argmax anyway, and near 1e-38 1/T overflows to NaN
)
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # int64 seeds from the API and unsigned 64-bit ones both fit
MAX_PENALTY, MAX_LOGIT_BIAS = 2.0, 100.0  # OpenAI's ranges


@dataclass
class SamplingParams:
    """How one request is decoded.

    `temperature` below 1e-5 (0 included) or `top_p` 0 means greedy. `n` completions share the prompt;
    with `best_of`, best_of completions are generated and the n of highest mean token logprob returned.
    `seed` makes sampling reproducible: completion i draws from the stream of (seed & (2**64-1), i), so a
    negative int64 seed is its two's complement. `max_tokens` 0 generates nothing. Penalties count this
    completion's output tokens only (OpenAI's definition); `logit_bias` maps token ids to additive biases.
    `prompt_logprobs` asks for the logprob (and top-k) of every prompt token after the first. `guide`
    constrains the output to JSON (any object, or a schema's documents; see grammar.py); with `reasoning`,
    only the answer after the reasoning, which may have a token budget (reasoning_gate.py).
    `top_k` 0 keeps every token; `min_p` drops tokens whose probability (after temperature) is below
    min_p times the most likely token's (0: off); `repetition_penalty` divides the positive logits and
    multiplies the negative ones of every token seen in the prompt or the output (1: off; vLLM's and
    transformers' definition)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    best_of: int | None = None
    prompt_logprobs: int | None = None
    guide: Guide | None = None
    reasoning: ReasoningSpec | None = None  # a thinking budget, and `guide` only after the reasoning

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        check_sampling(self.__dict__)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_p == 0

    @property
    def constrained(self) -> bool:
        """Whether a matcher masks this request's tokens (a grammar, a reasoning gate, or both)."""
        return self.guide is not None or self.reasoning is not None

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler must add penalties or biases to this request's logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.logit_bias or self.repetition_penalty != 1
        )

    @property
    def num_sequences(self) -> int:
        """Completions generated (best_of when set, else n)."""
        return self.n if self.best_of is None else self.best_of


# The sampling fields a model's generation_config.json may default (vLLM's list): a request that sets none of
# one takes the model's value (Engine.sampling_params), else SamplingParams' own (OpenAI's).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(generation_config: object) -> dict:
    """The GENERATION_DEFAULTS a transformers GenerationConfig sets explicitly (its diff from the class
    defaults, as vLLM reads it), as SamplingParams kwargs; a value the engine cannot run is left out."""
    to_diff = getattr(generation_config, "to_diff_dict", None)
    diff = to_diff() if callable(to_diff) else {}
    out = {}
    for name in GENERATION_DEFAULTS:
        value = diff.get(name)
        if name == "top_k" and _is_int(value) and value < 0:
            value = 0  # -1: off, as vLLM
        if value is None:
            continue
        try:
            check_sampling({name: value})
        except SamplingError:
            continue
        out[name] = float(value) if name != "top_k" else value
    return out


class SamplingError(ValueError):
    """A sampling value the engine cannot run; `field` names it (the request parser maps it to the body)."""

    def __init__(self, field: str, rule: str, value: object) -> None:
        super().__init__(f"SamplingParams.{field} {rule}, got {value!r}")
        self.field, self.rule, self.value = field, rule, value


def check_sampling(values: dict) -> None:
    """The engine's rules for the fields present in `values` (None means unset where a field may be unset).

    The one place these rules live: SamplingParams applies them, and the batch request parser calls this
    at validation, so validation lists exactly the problems the run would hit. Limits that need the model
    (token ids and top-k counts within the vocabulary) are checked by Engine.add_request."""
    for name, minimum in (("max_tokens", 0), ("top_k", 0), ("n", 1)):
        if name in values:
            _check_int(name, values[name], minimum)
    for name, minimum, maximum in (
        ("seed", MIN_SEED, MAX_SEED),
        ("logprobs", 0, None),
        ("best_of", 1, None),
        ("prompt_logprobs", 0, None),
    ):
        if values.get(name) is not None:
            _check_int(name, values[name], minimum, maximum)
    if values.get("best_of") is not None and values["best_of"] < values.get("n", 1):
        raise SamplingError("best_of", f"must be >= n ({values.get('n', 1)})", values["best_of"])
    _check_number(values, "temperature", 0.0, None)
    _check_number(values, "top_p", 0.0, 1.0)
    _check_number(values, "min_p", 0.0, 1.0)
    _check_number(values, "repetition_penalty", 0.0, None)
    if values.get("repetition_penalty") == 0:
        raise SamplingError("repetition_penalty", "must be a finite number > 0", 0)
    for name in ("presence_penalty", "frequency_penalty"):
        _check_number(values, name, -MAX_PENALTY, MAX_PENALTY)
    _check_logit_bias(values.get("logit_bias"))
    stop = values.get("stop")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise SamplingError("stop", "must be a list of non-empty strings", stop)
    ids = values.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(t) and t >= 0 for t in ids)):
        raise SamplingError("stop_token_ids", "must be non-negative ints", ids)
    _check_guide(values.get("guide"))


def _check_guide(guide: object) -> None:
    """A constraint the grammar compiler accepts (compiled once per distinct schema, then cached)."""
    if guide is None:
        return
    if not isinstance(guide, Guide):
        raise SamplingError("guide", "must be a grammar.Guide", guide)
    try:
        check(guide)
    except GrammarError as exc:
        raise SamplingError("guide", f"cannot be compiled: {exc}", guide.kind) from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bounds = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise SamplingError(name, f"must be an int {bounds}", value)


def _check_number(values: dict, name: str, minimum: float, maximum: float | None) -> None:
    if name not in values:
        return
    value = values[name]
    if not _is_number(value) or value < minimum or (maximum is not None and value > maximum):
        bounds = f"in [{minimum:g}, {maximum:g}]" if maximum is not None else f">= {minimum:g}"
        raise SamplingError(name, f"must be a finite number {bounds}", value)


def _check_logit_bias(bias: object) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise SamplingError("logit_bias", "must map token ids to numbers", bias)
    for token, value in bias.items():
        if not _is_int(token) or token < 0:
            raise SamplingError("logit_bias", "keys must be token ids (ints >= 0)", token)
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise SamplingError("logit_bias", f"values must be numbers in [-100, 100] (token {token})", value)
