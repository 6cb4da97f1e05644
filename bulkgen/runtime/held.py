"""What an engine worker holds and hands back: prepared requests, held ranges, and finished requests and
engine steps as plain data (no tensors cross the actor boundary)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from bulkgen.batch.requests import ParsedRequest
from bulkgen.metrics.health import OutputHealth
from bulkgen.runtime.parts import PartEntry, Tally
from bulkgen.runtime.ranges import RangeBounds, RangeOutcome


@dataclass
class Prepared:
    request_id: str
    range_key: tuple
    request: ParsedRequest
    prompt_ids: list[int]
    params: dict[str, Any]
    part: int = 0  # a completions line with several prompts runs one engine request per prompt:
    parts: int = 1  # this is prompt `part` of `parts`
    images: Any = None  # the prompt's images as the engine takes them (engine.multimodal.ImageInputs)


@dataclass
class HeldRange:
    """A range assigned to this worker: what of it is still running, and the entries of what finished."""

    bounds: RangeBounds
    model: str
    store: Any
    remaining: dict[int, str] = field(default_factory=dict)  # line -> custom_id
    entries: list[PartEntry] = field(default_factory=list)
    # successes whose output line the writer thread encodes, off the step loop: entry, request, engine result
    answers: list[tuple[PartEntry, ParsedRequest, dict]] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    health: OutputHealth = field(default_factory=OutputHealth)  # what its answers are (batch.health)
    fingerprint: str | None = None  # its lines' system_fingerprint (the engine's and the batch's options)
    partials: dict[int, dict[int, dict]] = field(default_factory=dict)  # line -> prompt part -> its result

    @property
    def batch_id(self) -> str:
        return self.bounds.batch_id

    @property
    def key(self) -> tuple:
        return self.bounds.key

    def outcome(self) -> RangeOutcome:
        tally = Tally()
        for e in self.entries:
            tally.add(e)
        return RangeOutcome(self.bounds, tally, self.metrics, health=self.health.to_state())


def split_step(record: dict) -> dict[str, dict]:
    """One engine step record as each batch's share: its own slots and tokens, and the step time in
    proportion to its tokens, so batches sharing a worker never count each other's work."""
    by_tag = record.get("by_tag") or {}
    total = sum(t["prefill_tokens"] + t["decode_tokens"] for t in by_tag.values()) or 1
    held_all = record.get("num_seqs") or 1
    out = {}
    for tag, t in by_tag.items():
        out[tag] = {
            "t": record["t"],
            "duration_s": record["duration_s"] * (t["prefill_tokens"] + t["decode_tokens"]) / total,
            "num_seqs": t["held"],
            "active_seqs": t["active"],
            "prefill_tokens": t["prefill_tokens"],
            "decode_tokens": t["decode_tokens"],
            "output_tokens": t.get("output_tokens", 0),
            "padding_slots": round(record.get("padding_slots", 0) * t["held"] / held_all),
            "max_num_seqs": record.get("max_num_seqs"),
            "batch_size": record.get("num_seqs", t["held"]),
        }
    return out


def result_dict(output) -> dict[str, Any]:
    """A finished RequestOutput as plain data (no tensors cross the actor boundary). Usage counts every
    generated token, those of best_of candidates that were not returned included (the engine's metrics)."""
    metrics = output.metrics
    returned = sum(len(c.token_ids) for c in output.outputs)
    return {
        "request_id": output.request_id,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": max(returned, metrics.num_output_tokens),
        "cached_tokens": metrics.num_cached_tokens,
        "completions": [
            {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": c.logprobs}
            for c in output.outputs
        ]
        if output.embedding is None
        else [{"index": 0, "embedding": output.embedding}],
        "prompt_logprobs": getattr(output, "prompt_logprobs", None),
        "metrics": metrics.as_dict(),
        "finished_at": time.time(),
    }


def echo_of(request: ParsedRequest, prompt_ids: list[int], tokenizer) -> dict[str, str]:
    """What `echo` puts before a completion: the prompt as written (token prompts decoded) and its first
    token, which the prompt logprobs do not cover."""
    text = request.prompt if isinstance(request.prompt, str) else tokenizer.decode(prompt_ids)
    return {"text": text, "first_token": tokenizer.decode(prompt_ids[:1])}
