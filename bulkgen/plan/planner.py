"""`bulkgen plan`: a batch file -> requests, tokens and an estimated wall time, before any worker starts.

The file is read once (bulkgen.plan.filework: the batch validator, the model's template and tokenizer),
expected lengths come from the length model (bulkgen.plan.lengths), and the simulator
(bulkgen.plan.timed) turns the work into seconds with the stored throughput profile of this model and
device (bulkgen.plan.profile), measured on the spot when there is none for the device at hand; a vision
model's encoder time for the file's images is in those seconds, and told apart (`encoder`).

What the estimate covers: `estimated_seconds` is the batch's generation wall time on N warm workers,
from its first request entering an engine to its last finishing: what `metrics.wall_time_s` of the
finished batch measures, and what a user of a running service waits for. A fresh `bulkgen run` pays its
start-up on top (Ray, its worker, the model load, the results): `startup_seconds`, measured with the
profile (bulkgen.plan.startup), printed apart because a running service does not pay it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from bulkgen.plan import profile as profiles
from bulkgen.plan.calibrate import Runtime, runtime_factor
from bulkgen.plan.filework import FileWork, ImageReader, file_work
from bulkgen.plan.lengths import LengthModel
from bulkgen.plan.timed import Encoder, batch_seconds


class NoProfile(Exception):
    """No stored profile for the device asked about, and it is not the device at hand to measure."""


def estimate(
    uncached: np.ndarray,
    max_tokens: np.ndarray,
    lengths: LengthModel,
    profile: profiles.Profile,
    workers: int,
    range_size: int = 32,
    runtime: Runtime | None = None,
    encoder: Encoder | None = None,
) -> dict[str, Any]:
    """Seconds as {low, expected, high} (the profile's step-time spread around the expected lengths) and
    the upper bound (every sequence runs to max_tokens). `runtime`: the service's measured runtime factor;
    `encoder`: a vision model's encoder work per sequence."""
    runtime = runtime or Runtime()
    limits = profiles.limits_of(profile)

    def seconds(outputs: np.ndarray) -> float:
        return runtime.seconds(
            batch_seconds(
                uncached,
                outputs,
                profile.step_seconds,
                limits,
                workers,
                range_size,
                encoder,
            )
        )

    expected = seconds(lengths.expected(max_tokens))
    upper = expected if math.isinf(lengths.cap) else seconds(max_tokens)
    return {
        "estimated_seconds": {
            "low": round(expected * (1 - profile.spread), 2),
            "expected": round(expected, 2),
            "high": round(expected * (1 + profile.spread), 2),
        },
        "upper_bound_seconds": round(upper * (1 + profile.spread), 2),
    }


def find_profile(
    store, model: str, path: str, device: str | None, kv_cache_dtype: str = "auto"
) -> tuple[profiles.Profile, bool]:
    """(profile, measured now?). `device`: None for this machine's, else a name as `profile` stores it or
    its tail ('h200' finds 'nvidia-h200'); with an FP8 KV cache, that device's FP8 profile. Another
    device without a stored profile: NoProfile."""
    here = profiles.device_key(profiles.device_name(), kv_cache_dtype)
    stored = profiles.stored_devices(store, model)
    wanted = here if device in (None, "", "auto") else profiles.device_key(device.lower(), kv_cache_dtype)
    match = [d for d in stored if d == wanted or d.endswith("-" + wanted)]
    if match:
        found = profiles.load(store, model, match[0])
        if found is not None:
            return found, False
    if not (wanted == here or here.endswith("-" + wanted)):
        raise NoProfile(
            f"no profile of {model} exists for device {wanted!r} (stored: {', '.join(stored) or 'none'}); "
            f"run `bulkgen profile` for this model on a machine with that device, on this storage"
        )
    profile = profiles.measure(model, path, {"kv_cache_dtype": kv_cache_dtype})
    profiles.save(store, profile)
    return profile, True


def plan_file(
    path: Path,
    endpoint: str,
    model: str,
    model_path: str,
    tokenizer,
    lengths: LengthModel,
    workers: int,
    max_requests: int,
    device: str | None = None,
    store=None,
    profile: profiles.Profile | None = None,
    batches=None,
    adapters: Iterable[str] = (),
    kv_cache_dtype: str = "auto",
    images: ImageReader | None = None,
) -> dict[str, Any]:
    """Scan the file (no profile needed: an invalid file is told before any measuring), then estimate with
    `profile`, or the one `find_profile` gives for `device` and `kv_cache_dtype` on `store`. `adapters`: the
    model's LoRA adapters its lines may name (estimated as the base model: an adapter's low-rank work is not
    modelled). `images`: a vision model's processor and where its images are (scan.ImageReader)."""
    from transformers import AutoConfig

    from bulkgen.engine.engine import _max_model_len  # the engine's own context rule

    max_model_len = _max_model_len(AutoConfig.from_pretrained(model_path, local_files_only=True), None)
    work = file_work(
        path, endpoint, model, tokenizer, max_model_len, max_requests, adapters=adapters, images=images
    )
    if not work.validation.ok:
        return {"file": str(path), "valid": False, "errors": work.validation.error_list()["data"]}
    measured_now = False
    if profile is None:
        profile, measured_now = find_profile(store, model, model_path, device, kv_cache_dtype)
    runtime = Runtime() if batches is None else runtime_factor(batches, model, profile)
    result = {
        "file": str(path),
        "valid": True,
        **summarize(work, lengths, profile, workers, runtime),
        "runtime_factor": runtime.source,
    }
    result["profile"] = {
        "stored_at": profiles.profile_key(model, profile.device),
        "measured_now": measured_now,
        "busy": profile.busy,
    }
    return result


def summarize(
    work: FileWork,
    lengths: LengthModel,
    profile: profiles.Profile,
    workers: int,
    runtime: Runtime | None = None,
) -> dict[str, Any]:
    prompts, uncached, max_tokens = work.arrays(profile.prefix_caching)
    expected = lengths.expected(max_tokens)
    prompt_total = int(prompts.sum())
    encoder = _encoder(work, profile)
    timed = estimate(uncached, max_tokens, lengths, profile, workers, runtime=runtime, encoder=encoder)
    # the same work without the encoder: what the encoder adds is the difference
    alone = estimate(uncached, max_tokens, lengths, profile, workers, runtime=runtime) if encoder else timed
    return {
        "model": profile.model,
        "device": profile.device,
        "workers": workers,
        "requests": work.validation.total,
        "refused_lines": work.refused,
        "prompt_tokens": prompt_total,
        "images": work.images,
        # at least 0: without a prefix cache each of `n` completions computes the prompt again
        "prefix_cache_share": round(max(0.0, 1 - int(uncached.sum()) / prompt_total), 4)
        if prompt_total
        else 0.0,
        "max_output_tokens": int(max_tokens.sum()),
        "expected_output_tokens": int(expected.sum()),
        "length_model": lengths.source,
        **timed,
        "encoder": _encoder_summary(work, profile, timed, alone),
        "startup_seconds": profile.startup_s,
        "model_load_seconds": profile.model_load_s,
        "kv_cache": {
            "dtype": profile.kv_cache_dtype,
            "bytes_per_token": profile.kv_bytes_per_token,
            "tokens": profile.kv_cache_tokens,
        },
    }


def _encoder(work: FileWork, profile: profiles.Profile) -> Encoder | None:
    """The vision encoder's seconds per sequence, from the profile's encoder cost (None without one)."""
    if profile.encoder_call_s is None or not work.images:
        return None
    images, tokens = work.encoded()
    return Encoder(profile.encoder_seconds(images, tokens), profile.encoder_call_s)


def _encoder_summary(
    work: FileWork, profile: profiles.Profile, timed: dict[str, Any], alone: dict[str, Any]
) -> dict[str, Any] | None:
    """What the encoder adds to the expected time (`timed`'s minus `alone`'s, the same work without it),
    with the images it encodes; None for a text model's plan. A profile without an encoder cost (stored
    before encoders were measured) leaves it out of the time, and says so."""
    if profile.encoder_call_s is None and not work.images:
        return None
    images, tokens = work.encoded()
    summary = {
        "images": int(images.sum()),
        "image_tokens": int(tokens.sum()),
        "seconds": None,
    }
    if profile.encoder_call_s is None:
        return summary
    seconds = timed["estimated_seconds"]["expected"] - alone["estimated_seconds"]["expected"]
    return {
        **summary,
        "seconds": round(seconds, 2),
        "call_s": profile.encoder_call_s,
        "per_image_s": profile.per_image_s,
        "per_image_token_s": profile.per_image_token_s,
    }


def describe(result: dict[str, Any]) -> str:
    """The plan as a user reads it in a terminal."""
    if not result["valid"]:
        lines = [f"{result['file']}: a batch of it would fail validation:"]
        lines += [
            f"  line {e['line']}: [{e['code']}] {e['message']}"
            if e["line"]
            else f"  [{e['code']}] {e['message']}"
            for e in result["errors"]
        ]
        return "\n".join(lines)
    rows = [*_work_rows(result), *_time_rows(result)]
    return "\n".join(f"{label:<20} {value}" for label, value in rows)


def _work_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """What the file asks for: requests, tokens in and out."""
    refused = result["refused_lines"]
    return [
        (
            "requests",
            f"{result['requests']:,}" + (f" ({refused} refused by their worker)" if refused else ""),
        ),
        (
            "prompt tokens",
            f"{result['prompt_tokens']:,} (exact, {result['model']}'s chat template and tokenizer"
            + (f"; {result['images']:,} images, by its processor)" if result.get("images") else ")"),
        ),
        (
            "prefix cache",
            f"{result['prefix_cache_share']:.0%} of prompt tokens shared with an earlier prompt",
        ),
        ("max output tokens", f"{result['max_output_tokens']:,}"),
        ("expected output", f"{result['expected_output_tokens']:,} tokens, from {result['length_model']}"),
    ]


def _time_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """How long it takes, and what the estimate stands on (the profile and its runtime factor)."""
    s, prof = result["estimated_seconds"], result["profile"]
    where = "measured just now" if prof["measured_now"] else "stored"
    rows = [
        (
            f"time on {result['workers']} worker" + ("s" if result["workers"] > 1 else ""),
            f"{_duration(s['low'])} - {_duration(s['high'])} (expected {_duration(s['expected'])}; "
            f"at most {_duration(result['upper_bound_seconds'])} if every request runs to max_tokens)",
        ),
        *_encoder_rows(result.get("encoder")),
        (
            "start-up",
            f"~{_duration(result['startup_seconds'])} more for a fresh `bulkgen run` (Ray, worker, model "
            f"load {_duration(result['model_load_seconds'])}); not in the time above",
        ),
        ("KV cache", _kv_line(result["kv_cache"])),
        ("profile", f"{result['device']}, {where}: {prof['stored_at']}"),
    ]
    if prof["busy"]:
        rows.append(
            ("", f"measured while the CPU was busy ({prof['busy']}): `bulkgen profile` again when it is not")
        )
    return [*rows, ("runtime factor", result["runtime_factor"])]


def _encoder_rows(encoder: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The vision encoder's share of the time: none for a text model."""
    if encoder is None:
        return []
    what = f"{encoder['images']:,} images ({encoder['image_tokens']:,} image tokens) to encode"
    if encoder["seconds"] is None:
        why = "the profile has no encoder cost: `bulkgen profile` again"
        return [("encoder", f"{what}: not in the time above ({why})")]
    terms = [
        (encoder["call_s"] * 1e3, "ms/call"),
        (encoder["per_image_s"] * 1e3, "ms/image"),
        (encoder["per_image_token_s"] * 1e6, "us/image token"),
    ]
    cost = " + ".join(f"{value:.2f} {unit}" for value, unit in terms if value) or "no measurable cost"
    return [("encoder", f"{_duration(encoder['seconds'])} of the time above: {what}, at {cost}")]


def _kv_line(kv: dict[str, Any]) -> str:
    if not kv["bytes_per_token"]:  # a profile measured before profiles recorded the cache
        return f"{kv['dtype']} (bytes per token not recorded: `bulkgen profile` again)"
    what = "fp8 (e4m3 + a scale per token and head)" if kv["dtype"] == "fp8" else "the model's dtype"
    return (
        f"{what}: {kv['bytes_per_token']:,} bytes per token; the profiled engine's cache held "
        f"{kv['tokens']:,} tokens ({kv['bytes_per_token'] * kv['tokens'] / (1 << 20):,.1f} MiB)"
    )


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
