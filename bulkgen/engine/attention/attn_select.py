"""Chooses the attention backend for a device by running each candidate on a small packed case.

Kernels the development machine cannot run (no GPU there) must not be trusted blindly: a candidate
is kept only if it matches the float32 `plain` backend at the model's head counts and dtype on three
probes over a paged cache: prefill only (a fresh prompt and a continuation chunk), decode only, and
both mixed, so a rejection names the part that failed (the prefill kernel or the decode path). With an
FP8 KV cache (kv_cache) the probes write and read an FP8 cache, so that path is what is checked.

On CUDA in bf16/fp16 the `plain` path (a per-sequence SDPA loop) is many times slower than a fused
kernel, so a GPU where no fused candidate passes is an error, not a warning, unless the user forces
`BULKGEN_ATTENTION=plain`, or every fused candidate was refused for a feature of the model it lacks
(`supports`: soft-capping, which no kernel here takes): then plain prefills (with the triton decode
kernel) are the only way to run the model, and the log says so. Each distinct layer attention of the
model (window, chunk, soft-cap, sinks, K/V head sizes) is probed (`probe_layer`). The chosen backend
carries `probe_report` (candidate -> "ok" or why it was rejected) for benchmarks and logs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from bulkgen.engine.attention import triton_decode
from bulkgen.engine.attention.attn_backends import BACKENDS, PlainBackend, cuda_candidates
from bulkgen.engine.attention.layer_attention import AttnKind, LayerAttention
from bulkgen.engine.kv import kv_cache
from bulkgen.engine.step_plan import HostPack, StepPlan

log = logging.getLogger(__name__)
TOLERANCE = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def select_backend(
    device: torch.device,
    dtype: torch.dtype,
    layers: list[LayerAttention],
    block_size: int,
    kv_dtype: torch.dtype | None = None,
):
    """The backend for a model whose layers attend as `layers` say (layer_attention.probe_layers), over
    a cache stored in `kv_dtype` (kv_cache; None: the model's dtype)."""
    kinds, kv_dtype = distinct(layers), kv_dtype or dtype
    forced = os.environ.get("BULKGEN_ATTENTION")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"BULKGEN_ATTENTION={forced!r}: choose one of {sorted(BACKENDS)}")
        backend = BACKENDS[forced]()
        missing = _unsupported(backend, kinds, kv_dtype)
        if missing:
            raise ValueError(f"BULKGEN_ATTENTION={forced!r} cannot run this model: {missing}")
        return _with_report(backend, {forced: "forced by BULKGEN_ATTENTION"})
    if device.type != "cuda":
        return _with_report(PlainBackend(), {})
    half = dtype in (torch.float16, torch.bfloat16)
    report: dict[str, str] = {}
    for backend in _cuda_variants(with_plain=True):
        missing = _unsupported(backend, kinds, kv_dtype)
        error = missing or next(
            (e for layer in kinds if (e := self_check(backend, device, dtype, layer, block_size, kv_dtype))),
            None,
        )
        report[_label(backend)] = error or "ok"
        if error is None and (backend.name != "plain" or not half or _all_fused_refused(report)):
            if backend.name == "plain" and half:
                log.warning(
                    "attention: no fused kernel takes this model (%s); prefills run per sequence", report
                )
            log.info("attention backend: %s", _label(backend))
            return _with_report(backend, report)
        if error is not None:
            log.warning("attention backend %s rejected: %s", _label(backend), error)
    if half:
        found = report or "this torch offers none"
        raise RuntimeError(
            f"no fused CUDA attention backend passed its check in {dtype} ({found}); the plain "
            "fallback would be many times slower. Set BULKGEN_ATTENTION=plain to run it anyway"
        )
    raise RuntimeError(f"no attention backend passed its check on {device} in {dtype}: {report}")


def distinct(layers: list[LayerAttention]) -> list[LayerAttention]:
    """One layer of each distinct attention (what kernels see; the query-position scale is not theirs)."""
    return list(dict.fromkeys(replace(layer, temperature=None) for layer in layers))


def _unsupported(backend, layers: list[LayerAttention], kv_dtype: torch.dtype) -> str | None:
    if kv_dtype == kv_cache.FP8 and not getattr(backend, "reads_fp8_kv", True):
        return "an FP8 KV cache: this kernel reads the cache itself and takes no per-row scales"
    return next((reason for layer in layers if (reason := backend.supports(layer))), None)


def _all_fused_refused(report: dict[str, str]) -> bool:
    """True when every fused candidate was refused for a feature it lacks (not for failing its check):
    then the plain prefill is the only way to run the model, and taking it is no silent slowdown."""
    fused = {label: why for label, why in report.items() if not label.startswith("plain")}
    return bool(fused) and all(why.startswith(_FEATURE_REASONS) for why in fused.values())


_FEATURE_REASONS = (
    "logit soft-capping",
    "sliding windows",
    "chunked attention",
    "K and V heads",
    "head size",
    "an FP8 KV",
)


def _cuda_variants(with_plain: bool):
    """Each CUDA candidate, fastest first; those whose decode rows go through `paged_decode` once with
    the triton decode kernel (where it imports) and once with the padded one."""
    kernels = ["triton", "padded"] if triton_decode.available() else ["padded"]
    for name in [*cuda_candidates(), *(["plain"] if with_plain else [])]:
        cls = BACKENDS[name]
        if issubclass(cls, PlainBackend):
            yield from (cls(decode_kernel=kernel) for kernel in kernels)
        else:
            yield cls()


def _label(backend) -> str:
    kernel = getattr(backend, "decode_kernel", None)
    return f"{backend.name}+{kernel}_decode" if kernel else backend.name


def _with_report(backend, report: dict[str, str]):
    backend.probe_report = report
    return backend


def probe_plan(block_size: int, starts=None, counts=None, num_prefill: int = 2) -> StepPlan:
    """Default: a fresh 7-token prompt, a 5-token continuation chunk and two decodes, on disjoint blocks."""
    bs = block_size
    starts, counts = starts or [0, bs + 3, 2 * bs + 1, 5], counts or [7, 5, 1, 1]
    tables, next_block = [], 0
    for start, n in zip(starts, counts, strict=True):
        width = -(-(start + n) // bs)
        tables.append(list(range(next_block, next_block + width)))
        next_block += width
    return StepPlan(starts, counts, tables, num_prefill=num_prefill, block_size=bs)


def probe_plans(block_size: int) -> dict[str, list[StepPlan]]:
    """The probes by the part of a step they exercise: prefill only, decode only, and mixed steps."""
    bs = block_size
    return {
        "prefill kernel": [probe_plan(bs, [0, bs + 3], [7, 5]), probe_plan(bs, [0, 0], [6, 3])],
        "decode path": [probe_plan(bs, [3, 2 * bs, bs - 1], [1, 1, 1], 0)],
        "mixed step": [probe_plan(bs), probe_plan(bs, [0, 0, bs + 2], [6, 3, 1])],
    }


def probe_layer(layer: LayerAttention) -> LayerAttention:
    """`layer` as the probes test it: a window of 3 and chunks of 4 (the probes' sequences cross them)
    and a soft-cap of 1 (random scores of about 1 are bent by it)."""
    kind = AttnKind(
        window=min(layer.kind.window, 3) if layer.kind.window else None,
        chunk=min(layer.kind.chunk, 4) if layer.kind.chunk else None,
    )
    return replace(layer, kind=kind, softcap=1.0 if layer.softcap else None)


def run_backend(backend, plan: StepPlan, layer: LayerAttention, q, k, v, k_cache, v_cache, scale, sinks=None):
    """Write this step's K/V into copies of the caches and attend, as one layer of a forward would."""
    pack = HostPack(q.device)
    meta = backend.prepare(plan, pack, layer.kind)
    slots = pack.add(plan.slots())
    flat = pack.upload()
    meta = backend.bind(meta, flat)
    k_cache = k_cache.clone()
    k = kv_cache.write(k_cache, flat[slots], k)
    if layer.latent:  # MLA: V is K's leading columns, a view of the K cache as the engine allocates it
        v_cache, v = kv_cache.leading(k_cache, layer.v_dim), k[..., : layer.v_dim]
    else:
        v_cache = v_cache.clone()
        v = kv_cache.write(v_cache, flat[slots], v)
    return backend.attend(q, k, v, k_cache, v_cache, meta, scale, layer.softcap, sinks)


def self_check(backend, device, dtype, layer: LayerAttention, block_size: int, kv_dtype=None) -> str | None:
    """None if `backend` matches `plain` in float32 on every probe step for `layer` (its window, chunk,
    soft-cap, sinks and head shapes: see probe_layer), else why not (naming the part). With an FP8
    `kv_dtype` both read the same FP8 cache (the reference dequantizes it to float32)."""
    layer = probe_layer(layer)
    for part, plans in probe_plans(block_size).items():
        for plan in plans:
            error = _check_plan(backend, plan, device, dtype, layer, block_size, kv_dtype == kv_cache.FP8)
            if error is not None:
                return f"{part}: {error}"
    return None


def _check_plan(
    backend, plan, device, dtype, layer: LayerAttention, block_size: int, fp8: bool
) -> str | None:
    gen = torch.Generator().manual_seed(0)
    tokens, blocks = sum(plan.counts), sum(len(t) for t in plan.block_tables)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    hkv, dk, dv = layer.kv_heads, layer.k_dim, layer.v_dim
    q, k, v = rand(tokens, layer.q_heads, dk), rand(tokens, hkv, dk), rand(tokens, hkv, dv)
    k_cache, v_cache = rand(blocks, block_size, hkv, dk), rand(blocks, block_size, hkv, dv)
    if fp8:  # both read one FP8 cache and write the same rows (this step's K/V rounded to `dtype` first)
        k_cache, v_cache = (kv_cache.Fp8Cache(*kv_cache.quantize(c)) for c in (k_cache, v_cache))
        k, v = k.to(dtype).float(), v.to(dtype).float()
    sinks = rand(layer.q_heads) if layer.sinks else None
    scale = dk**-0.5
    try:
        reference = PlainBackend(decode_kernel="padded")
        want = run_backend(reference, plan, layer, q, k, v, k_cache, v_cache, scale, sinks)
        q, k, v = (t.to(dtype) for t in (q, k, v))
        if not fp8:
            k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
        got = run_backend(backend, plan, layer, q, k, v, k_cache, v_cache, scale, sinks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this backend
        return f"{type(exc).__name__}: {exc}"
    err = (got.float() - want).abs().max().item()
    return None if err <= TOLERANCE.get(dtype, 4e-2) else f"max abs error {err:.3g} against plain"
