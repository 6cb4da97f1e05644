"""What the engine hands back: completions, per-request timings, and the request that groups them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace


@dataclass
class CompletionOutput:
    """One of a request's `n` completions. `logprobs` entries are {"token", "logprob", "top_logprobs":
    [{"token", "logprob"}]}, from the distribution after penalties and logit_bias (before temperature)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    logprobs: list[dict] | None = None
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs (with logprobs or best_of)


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) and counts, so a batch can report TTFT/TPOT/queue wait."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (over all n completions' tokens)."""
        if self.num_output_tokens < 2 or self.finished_time is None or self.first_token_time is None:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def queue_wait_s(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, queue_wait_s=self.queue_wait_s)
        return out


@dataclass
class RequestOutput:
    """A finished request: its prompt ids, its completions in index order, and its metrics.

    `prompt_logprobs` (when asked for): one entry per prompt token after the first, shaped like
    CompletionOutput.logprobs entries, from the raw model distribution. An embedding request
    (pooling.EmbedParams) has no completions and its `embedding`. A request that failed on its own (its
    output's grammar failed during decoding, see grammar.py) has no completions and its `error`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict] | None = None
    embedding: list[float] | None = None  # an embedding request's vector (no completions)
    error: str | None = None  # why the request failed (no completions)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason


def best_of(outputs: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The `n` completions of highest mean token logprob (cumulative / length, as vLLM), re-indexed 0..n-1
    in ranking order; ties keep generation order."""
    ranked = sorted(outputs, key=lambda c: (-c.cumulative_logprob / max(len(c.token_ids), 1), c.index))
    return [replace(c, index=i) for i, c in enumerate(ranked[:n])]
