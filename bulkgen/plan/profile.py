"""The throughput profile of one model on one device: what `bulkgen plan` turns a file into time with.

`measure` runs the real engine over a small grid (batch sizes × context lengths, synthetic token prompts,
`ignore_eos` so every sequence runs its full length) and fits one step-cost model to the engine's own
step records:

    step seconds = base + per_seq × sequences in the step + per_prefill_token × prefill tokens
                   + per_context_token × context tokens the decoding sequences attend to

It runs in a fresh process in the state of a worker's: one thread loads the model and runs every step
(bulkgen.runtime.engine_loop does all torch work on its engine thread). Torch work on a second thread
of one process (a model loaded on one thread and stepped on another) makes a second OpenMP team;
libgomp, seeing more threads than cores, then stops spinning between parallel regions, and on an idle
2-core machine every step ran 1.3-1.5x slower than the worker's: plans of a quiet machine came out that
much too long. It also times the model load, a vision-language model's encoder (bulkgen.plan.encoder: the
grid's token prompts never run it) and the start-up of a fresh `bulkgen run` (bulkgen.plan.startup). The profile is stored as JSON under the storage root, one object per model and
device (`layout.profile`), so `bulkgen plan`, `bulkgen serve` (the estimate at create) and every replica
on the same storage read the same figures.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from bulkgen.plan.fit import nonnegative_lstsq
from bulkgen.plan.timed import EngineLimits, attended
from bulkgen.store import NotFound, Store, layout

PROFILE_VERSION = 3  # 3: measured in a worker's process state, with the start-up of `bulkgen run`
BATCH_SIZES = (1, 16, 64)
CONTEXTS = (32, 256)
DECODE_STEPS = 8
CHURN_ROUNDS = 3
MEASURE_TIMEOUT_S = 1800


@dataclass
class Profile:
    """Fitted step costs (seconds) and the engine limits they were measured under."""

    model: str
    device: str
    base_s: float
    per_seq_s: float
    per_prefill_token_s: float
    per_context_token_s: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    model_load_s: float
    per_new_seq_s: float = 0.0  # admitting a sequence (and, later, finishing it): per request, not per token
    # relative spread of step times (half the interquartile range / median): the ± of plans
    spread: float = 0.15
    decode_padded: bool = False  # decodes attend over the longest one's blocks, each (bulkgen.plan.timed)
    startup_s: float = 0.0  # a fresh `bulkgen run` beyond its generation (Ray, worker, model load)
    busy: str = ""  # what else kept the cores busy when it was measured ("" when they were free)
    measured_at: float = field(default_factory=time.time)
    host: str = field(default_factory=platform.node)
    points: list[dict] = field(default_factory=list)
    version: int = PROFILE_VERSION
    # the engine's prefix cache: off for hybrid models (engine/features/state_slots.py), so plans count every
    # sequence's whole prompt
    prefix_caching: bool = True
    # the measured engine's KV cache (engine/kv/kv_cache.py): what it stores, the bytes one token's K/V take
    # over all layers (an FP8 cache's scales counted), and how many tokens its blocks held
    kv_cache_dtype: str = "auto"
    kv_bytes_per_token: int = 0
    kv_cache_tokens: int = 0
    # a vision model's encoder (bulkgen.plan.encoder): one call's fixed seconds, then per image and per image
    # token; None: not measured (a text model, or a profile stored before encoders were measured)
    encoder_call_s: float | None = None
    per_image_s: float = 0.0
    per_image_token_s: float = 0.0

    def step_seconds(self, seqs: int, prefill_tokens: int, context_tokens: int, new_seqs: int = 0) -> float:
        return (
            self.base_s
            + self.per_seq_s * seqs
            + self.per_prefill_token_s * prefill_tokens
            + self.per_context_token_s * context_tokens
            + self.per_new_seq_s * new_seqs
        )

    def encoder_seconds(self, images, image_tokens):
        """The encoder's seconds for one request's images, beyond its call's fixed cost (ints, or arrays of
        them: a second per request)."""
        return self.per_image_s * images + self.per_image_token_s * image_tokens

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Profile:
        fields = json.loads(data)
        if fields.get("version") != PROFILE_VERSION:
            raise ValueError(
                f"profile version {fields.get('version')} is not {PROFILE_VERSION}; measure it again"
            )
        return cls(**fields)


def limits_of(profile: Profile) -> EngineLimits:
    """The engine's limits and decode layout a profile was measured under, for the simulator."""
    return EngineLimits(
        profile.max_num_seqs, profile.max_num_batched_tokens, profile.block_size, profile.decode_padded
    )


def device_name(device: str | None = None) -> str:
    """'cpu', or the GPU's name in lower case without spaces ('nvidia-h200'): what profiles are keyed by."""
    import torch

    if (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu":
        return "cpu"
    return torch.cuda.get_device_name(0).lower().replace(" ", "-")


def profile_key(model: str, device: str) -> str:
    return layout.profile(model, device)


def load(store: Store, model: str, device: str) -> Profile | None:
    """The stored profile, or None when this model was never profiled on this device."""
    try:
        return Profile.from_json(store.read_bytes(profile_key(model, device)))
    except (NotFound, ValueError, TypeError):
        return None


def save(store: Store, profile: Profile) -> str:
    key = profile_key(profile.model, profile.device)
    store.write_bytes(key, profile.to_json())
    return key


def stored_devices(store: Store, model: str) -> list[str]:
    return sorted(layout.profile_device(k) for k in store.list(layout.model_profiles(model)))


def measure(
    model: str,
    path: str,
    engine_kwargs: dict | None = None,
    threads: int | None = None,
    startup: bool = True,
) -> Profile:
    """Measure the grid in a fresh process (about 5-15 s on CPU with the bundled model), then, with
    `startup`, the start-up of a fresh `bulkgen run` of this model (one more model load, and Ray).

    `threads`: the worker's torch threads (a CPU worker's share of the cores; default all of them: one
    worker). A fresh process, not this one: whatever torch work this process did before (on its main
    thread, say) would change the step times it measures."""
    busy = _busy()
    args = {"model": model, "path": path, "engine_kwargs": engine_kwargs or {}, "threads": threads}
    threads = threads or os.cpu_count() or 1
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}  # as the pool sets
    done = subprocess.run(
        [sys.executable, "-m", "bulkgen.plan.profile", json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=MEASURE_TIMEOUT_S,
    )
    if done.returncode != 0:
        from bulkgen.plan.startup import failure_line

        raise RuntimeError(f"profiling {model} failed: {failure_line(done.stderr)}")
    profile = Profile.from_json(done.stdout.strip().splitlines()[-1].encode())
    profile.busy = busy
    if startup:
        from bulkgen.plan.startup import run_startup_seconds

        profile.startup_s = run_startup_seconds(model, path)
    return profile


def _busy() -> str:
    """The load on the cores, in words, when it would slow the measurement: a profile measured on a busy
    CPU times steps that wait for the cores (on 2 shared cores, 2-5x the idle machine's) and is kept."""
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return f"load average {load:.1f} on {cores} cores" if load > cores / 2 else ""


def measure_here(
    model: str, path: str, engine_kwargs: dict | None = None, threads: int | None = None
) -> Profile:
    """The grid (and a vision model's encoder) in this process, on one thread that loads the model and runs
    every step, as a worker's engine thread does. Meant for a fresh process (`measure`)."""
    result: list = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            measure()
        except BaseException as exc:  # raised in the caller's thread, below
            failed.append(exc)

    def measure() -> None:
        import torch

        from bulkgen.engine import Engine
        from bulkgen.plan.encoder import measure_encoder

        torch.set_num_threads(threads or os.cpu_count() or 1)  # per thread, as the worker's loop sets it
        started = time.perf_counter()
        engine = Engine.from_pretrained(path, **(engine_kwargs or {}))
        load_s = time.perf_counter() - started
        result.append((engine, load_s, _measure_grid(engine), measure_encoder(engine)))

    worker = threading.Thread(target=run, name="bulkgen-profile")
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    return _profile(model, *result[0])


def _profile(model: str, engine, load_s: float, grid: tuple[list, list], encoder=None) -> Profile:
    """The measured grid fitted into a Profile of `engine`'s device and limits, with `encoder` (an
    EncoderCost: a vision model's) beside it."""
    cells, churn = grid
    base, per_seq, per_prefill, per_context, per_new_seq = fit_steps(cells, churn)
    cfg = engine.config
    return Profile(
        model,
        device_key(device_name(str(engine.device.type)), cfg.kv_cache_dtype),
        base,
        per_seq,
        per_prefill,
        per_context,
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        engine.max_model_len,
        cfg.block_size,
        round(load_s, 3),
        decode_padded=decode_padded(engine),
        per_new_seq_s=per_new_seq,
        spread=_spread(cells),
        points=[
            {
                "batch": b,
                "context": c,
                "decode_step_s": round(_mean_decode(rows)[1], 6),
                "prefill_tokens_per_s": round(_prefill_rate(rows), 1),
            }
            for b, c, rows in cells
        ],
        prefix_caching=cfg.enable_prefix_caching,
        kv_cache_dtype=kv_label(cfg.kv_cache_dtype),
        kv_bytes_per_token=engine.runner.layout.token_bytes(engine.runner.kv_dtype),
        kv_cache_tokens=engine.runner.num_blocks * cfg.block_size,
        **({} if encoder is None else asdict(encoder)),
    )


def kv_label(kv_cache_dtype: str | None) -> str:
    """The name a profile records for a `kv_cache_dtype` ("fp8_e4m3" is "fp8")."""
    return "fp8" if (kv_cache_dtype or "auto").startswith("fp8") else "auto"


def device_key(device: str, kv_cache_dtype: str | None) -> str:
    """Where a device's profile is stored: one per device and KV cache dtype ("nvidia-h200", "nvidia-h200-kv-fp8"),
    as an FP8 cache changes both the step costs and the blocks."""
    label = kv_label(kv_cache_dtype)
    return device if label == "auto" else f"{device}-kv-{label}"


def fit_steps(cells: list, churn: list) -> tuple[float, float, float, float, float]:
    """(base, per_seq, per_prefill_token, per_context_token, per_new_seq) seconds, fitted to the grid's
    step rows (`_run_cell`'s) and the churn cell's."""
    base, per_seq, per_context = _fit_decode(cells)
    prefill_rows = [r for _, _, rows in cells for r in rows] + churn
    per_prefill, per_new_seq = _fit_admission(prefill_rows, (base, per_seq, per_context))
    return base, per_seq, per_prefill, per_context, per_new_seq


def decode_padded(engine) -> bool:
    """Whether the engine's decode attention pads every decoding sequence to the longest one (the plain
    backend's SDPA path: CPU, and CUDA without triton) rather than reading each one's own blocks."""
    from bulkgen.engine.attention import triton_decode
    from bulkgen.engine.attention.attn_backends import PlainBackend

    backend = engine.runner.backend
    kernel = getattr(backend, "decode_kernel", None) or triton_decode.default_kernel(engine.device)
    return isinstance(backend, PlainBackend) and kernel != "triton"


def _measure_grid(engine) -> tuple[list, list]:
    _run_cell(engine, 4, 16, 4)  # warm-up: the first forward passes are slower than the rest
    cells = [
        (batch, context, _run_cell(engine, batch, context, DECODE_STEPS))
        for context in CONTEXTS
        if context + DECODE_STEPS < engine.max_model_len
        for batch in BATCH_SIZES
        if batch <= engine.config.max_num_seqs
    ]
    churn = [r for _ in range(CHURN_ROUNDS) for r in _run_cell(engine, engine.config.max_num_seqs, 4, 2)]
    return cells, churn


def _run_cell(engine, batch: int, context: int, steps: int) -> list[tuple]:
    """(sequences, prefill tokens, context tokens, seconds, sequences prefilling) of every step of a cell."""
    from bulkgen.engine import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    vocab = min(engine.vocab_size, len(engine.tokenizer))
    rng = np.random.default_rng(batch * 7919 + context)
    for i in range(batch):  # random ids: no shared prefix, so the cache cannot shorten the prefill
        engine.add_request(f"p{batch}-{context}-{i}", rng.integers(3, vocab, context).tolist(), params)
    while engine.has_unfinished():
        engine.step()
    rows, decoded, padded = [], 0, decode_padded(engine)
    for record in engine.pop_step_records():
        decoding = record["decode_tokens"]
        decoded += bool(decoding)
        rows.append(
            (
                record["active_seqs"],
                record["prefill_tokens"],
                attended([context + decoded] * decoding, engine.config.block_size, padded),
                record["duration_s"],
                record["active_seqs"] - decoding,
            )
        )
    engine.reset()
    return rows


def _prefill_rate(rows: list[tuple[int, int, int, float]]) -> float:
    tokens = sum(r[1] for r in rows if r[1])
    seconds = sum(r[3] for r in rows if r[1])
    return tokens / seconds if seconds else 0.0


def _mean_decode(rows: list[tuple[int, int, int, float]]) -> tuple[float, float]:
    """(mean context tokens, mean seconds) of a cell's pure decode steps. The mean, not the median: a
    batch's wall time is a sum of steps, the slow ones (another process took the cores) included."""
    decode = [r for r in rows if r[1] == 0 and r[0]]
    return float(np.mean([r[2] for r in decode])), float(np.mean([r[3] for r in decode]))


def _spread(cells) -> float:
    spreads = []
    for _, _, rows in cells:
        times = [r[3] for r in rows if r[1] == 0 and r[0]]
        q1, median, q3 = np.percentile(times, [25, 50, 75])
        spreads.append((q3 - q1) / (2 * median))
    return round(float(np.clip(np.median(spreads), 0.05, 0.4)), 3)


def _fit_decode(cells) -> tuple[float, float, float]:
    """base + per_seq × batch + per_context × context tokens, on one median per cell, each kept >= 0."""
    x, y = [], []
    for batch, _, rows in cells:
        context, seconds = _mean_decode(rows)
        x.append([1.0, batch, context])
        y.append(seconds)
    return tuple(nonnegative_lstsq(np.array(x), np.array(y)))


def _fit_admission(rows: list[tuple], coef: tuple[float, float, float]) -> tuple[float, float]:
    """(seconds per prefill token, seconds per sequence admitted): what steps that prefill cost beyond
    decode steps of as many sequences over as much context, fitted together over the grid's prompts (32
    and 256 tokens) and the churn cell's (4 tokens, a full batch admitted every other step), each step
    weighed by its own length. Fitted apart, as before, the per-token cost took the admissions' share and
    the context of the sequences decoding beside the prompts: 5-20% high for a file of short prompts."""
    base, per_seq, per_context = coef
    steps = [r for r in rows if r[1]]
    if not steps:
        return 0.0, 0.0
    weight = np.array([1 / max(r[3], 1e-9) for r in steps])
    x = np.array([[r[1], r[4]] for r in steps]) * weight[:, None]
    y = np.array([r[3] - base - per_seq * r[0] - per_context * r[2] for r in steps]) * weight
    per_prefill, per_new_seq = nonnegative_lstsq(x, y)
    return per_prefill, per_new_seq


# `measure`'s fresh process: measure_here's arguments as JSON in, the profile as JSON out
if __name__ == "__main__":
    _args = json.loads(sys.argv[1])
    try:
        _measured = measure_here(**_args)
    except Exception as _exc:  # `measure` reports the last line: the error in one line, not a traceback
        if os.environ.get("BULKGEN_TRACEBACK"):
            raise
        print(f"{type(_exc).__name__}: {' '.join(str(_exc).split())}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(asdict(_measured)))
