"""The estimate a batch carries from validation on: `metrics.estimated_completion_at`, and the window check.

Validation streams the input once (bulkgen.batch.lifecycle); `WorkTally.add` rides on that same pass as
one more `on_request` callback, so the estimate costs no second read. The driver has no tokenizer, so
prompt tokens are the line index's estimate (bulkgen.batch.budget.prompt_estimate) and a missing
max_tokens counts as UNKNOWN_MAX_TOKENS; a vision model's images cost its profile's encoder time, each at
IMAGE_TOKENS_GUESS tokens; `bulkgen plan` gives the exact figures.

The service uses the newest profile stored for the batch's model (`bulkgen profile` on its storage), the
length model of bulkgen.plan.lengths, and its configured worker count. The queue ahead is counted cheaply:
the requests already pending in the runtime's work queue, at this batch's own seconds per request.

A batch whose low estimate, alone on the workers, is longer than its completion window:
  - by default it is accepted, and its `errors` carries one `completion_window_infeasible_warning` entry
    (the batch runs; what is not done at the window's end expires as usual, keeping finished work);
  - with `--refuse-infeasible` it is failed at once with `completion_window_infeasible` and the create call
    answers 400, before any worker time is spent.
Without a stored profile there is no estimate and nothing is refused.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bulkgen.batch import lifecycle
from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.budget import IMAGE_TOKENS_GUESS, output_budget, prompt_estimate
from bulkgen.batch.requests import ParsedRequest
from bulkgen.batch.schema import BatchStatus, InvalidRequest
from bulkgen.plan import profile as profiles
from bulkgen.plan.calibrate import runtime_factor
from bulkgen.plan.lengths import HISTOGRAM_KEY, MAX_OUTPUT_KEY, from_history, histogram
from bulkgen.plan.planner import estimate
from bulkgen.plan.timed import Encoder

INFEASIBLE = "completion_window_infeasible"


@dataclass
class WorkTally:
    """Per sequence: estimated prompt tokens, max_tokens and images, collected as validation streams by."""

    # 32-bit arrays, 4 bytes a value (a list of ints takes ~40), the API holds a whole file's while it
    # validates: a prompt is estimated from a line's bytes, max_tokens clipped to MAX_WORK_TOKENS (2**24)
    prompts: array = field(default_factory=lambda: array("i"))
    max_tokens: array = field(default_factory=lambda: array("i"))
    images: array = field(default_factory=lambda: array("i"))  # what the encoder runs: the first sequence's

    def add(self, number: int, start: int, raw: bytes, request: ParsedRequest) -> None:
        max_tokens, sequences = output_budget(request)
        prompt = prompt_estimate(request)
        for k in range(sequences):
            self.prompts.append(max(1, prompt) if k == 0 else 0)
            self.max_tokens.append(max_tokens)
            self.images.append(len(request.images) if k == 0 else 0)

    def encoder(self, profile: profiles.Profile) -> Encoder | None:
        """The images' encoder work by the profile's costs (None without an encoder cost or images)."""
        if profile.encoder_call_s is None or not any(self.images):
            return None
        images = np.array(self.images, np.int64)
        return Encoder(profile.encoder_seconds(images, images * IMAGE_TOKENS_GUESS), profile.encoder_call_s)


def newest_profile(store, model: str) -> profiles.Profile | None:
    found = [p for d in profiles.stored_devices(store, model) if (p := profiles.load(store, model, d))]
    return max(found, key=lambda p: p.measured_at, default=None)


def plan_record(
    record: BatchRecord,
    tally: WorkTally,
    store,
    batches,
    workers: int,
    queued_requests: int,
    now: float | None = None,
) -> BatchRecord:
    """The record with its estimate (and, if infeasible alone, a warning in `errors`); unchanged without a
    profile. `store`: the storage root (profiles); `batches`: the tenant's BatchRepo (length history)."""
    max_tokens = np.array(tally.max_tokens, np.int64)
    internal = record.internal
    internal[MAX_OUTPUT_KEY], internal[HISTOGRAM_KEY] = int(max_tokens.sum()), histogram(max_tokens)
    profile = newest_profile(store, record.model) if len(max_tokens) else None
    if profile is None:
        return record
    now = time.time() if now is None else now
    lengths = from_history(batches, record.model)
    runtime = runtime_factor(batches, record.model, profile)
    prompts, encoder = np.array(tally.prompts, np.int64), tally.encoder(profile)
    plan = estimate(prompts, max_tokens, lengths, profile, workers, runtime=runtime, encoder=encoder)
    seconds = plan["estimated_seconds"]
    queue_s = queued_requests * seconds["expected"] / len(max_tokens)
    record.metrics = {
        **(record.metrics or {}),
        "estimated_seconds": seconds,
        "queued_requests_ahead": queued_requests,
        "estimated_completion_at": int(now + queue_s + seconds["expected"]),
        "estimate_basis": f"profile {profile.device}, {lengths.source}",
    }
    window = record.expires_at - now
    if seconds["low"] > window:
        entry = {
            "code": INFEASIBLE + "_warning",
            "line": None,
            "param": "completion_window",
            "message": infeasible_message(seconds["low"], record.completion_window, workers),
        }
        errors = record.errors or {"object": "list", "data": []}
        record.errors = {**errors, "data": [*errors["data"], entry]}
    return record


def infeasible_message(low_s: float, window: str, workers: int) -> str:
    return (
        f"this batch needs at least {low_s:,.0f} s on {workers} worker(s) even alone (estimate from the stored "
        f"throughput profile), longer than its completion window of {window}; use a longer window, split the "
        "file, or add workers"
    )


def is_infeasible(record: BatchRecord) -> bool:
    return any(e["code"] == INFEASIBLE + "_warning" for e in (record.errors or {}).get("data", []))


def estimate_into(
    svc, tally: WorkTally, queued_requests: int, refuse: bool = False
) -> Callable[[BatchRecord], BatchRecord]:
    """The validation's `amend`: writes the estimate (and a window warning) into the record in the write that
    makes it `in_progress`. `refuse` (`--refuse-infeasible`): a batch its window cannot hold even alone is
    `failed` in that same write (code completion_window_infeasible), so no runner ever starts it."""
    workers = svc.settings.workers.num_workers or svc.settings.workers.cpu_workers

    def amend(record: BatchRecord) -> BatchRecord:
        record = plan_record(record, tally, svc.root, svc.batches, workers, queued_requests)
        if not (refuse and is_infeasible(record)):
            return record
        warning = next(e for e in record.errors["data"] if e["code"] == INFEASIBLE + "_warning")
        return lifecycle.fail(record, {"object": "list", "data": [{**warning, "code": INFEASIBLE}]})

    return amend


def raise_if_refused(record: BatchRecord) -> None:
    """`--refuse-infeasible`: a batch its window cannot hold even alone was failed as it was validated at
    create (bulkgen.runtime.driver); the create call answers 400 naming why."""
    refused = [e for e in (record.errors or {}).get("data", []) if e["code"] == INFEASIBLE]
    if record.status == BatchStatus.FAILED and refused:
        raise InvalidRequest(refused[0]["message"], param="completion_window", code=INFEASIBLE)
