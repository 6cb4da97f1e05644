"""Chooses the attention backend for a device by running each candidate on a small packed case.

Kernels the development machine cannot run (no GPU there) must not be trusted blindly: a candidate
is kept only if it matches the float32 `plain` backend at the model's head counts and dtype on three
probes over a paged cache: prefill only (a fresh prompt and a continuation chunk), decode only, and
both mixed, so a rejection names the part that failed (the prefill kernel or the decode path).

On CUDA in bf16/fp16 the `plain` path (a per-sequence SDPA loop) is many times slower than a fused
kernel, so a GPU where no fused candidate passes is an error, not a warning, unless the user forces
`BULKGEN_ATTENTION=plain`. The chosen backend carries `probe_report` (candidate -> "ok" or why it was
rejected) for benchmarks and logs.
"""

from __future__ import annotations

import logging
import os

import torch

from . import triton_decode
from .attn_backends import BACKENDS, PlainBackend, cuda_candidates
from .step_plan import HostPack, StepPlan

log = logging.getLogger(__name__)
TOLERANCE = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def select_backend(
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
):
    forced = os.environ.get("BULKGEN_ATTENTION")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"BULKGEN_ATTENTION={forced!r}: choose one of {sorted(BACKENDS)}")
        return _with_report(BACKENDS[forced](), {forced: "forced by BULKGEN_ATTENTION"})
    if device.type != "cuda":
        return _with_report(PlainBackend(), {})
    half = dtype in (torch.float16, torch.bfloat16)
    report: dict[str, str] = {}
    for backend in _cuda_variants(with_plain=not half):
        error = self_check(backend, device, dtype, num_heads, num_kv_heads, head_dim, block_size)
        report[_label(backend)] = error or "ok"
        if error is None:
            log.info("attention backend: %s", _label(backend))
            return _with_report(backend, report)
        log.warning("attention backend %s rejected: %s", _label(backend), error)
    if half:
        found = report or "this torch offers none"
        raise RuntimeError(
            f"no fused CUDA attention backend passed its check in {dtype} ({found}); the plain "
            "fallback would be many times slower. Set BULKGEN_ATTENTION=plain to run it anyway"
        )
    raise RuntimeError(f"no attention backend passed its check on {device} in {dtype}: {report}")


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


def run_backend(backend, plan: StepPlan, q, k, v, k_cache, v_cache, scale: float) -> torch.Tensor:
    """Write this step's K/V into copies of the caches and attend, as one layer of a forward would."""
    pack = HostPack(q.device)
    meta = backend.prepare(plan, pack)
    slots = pack.add(plan.slots())
    flat = pack.upload()
    meta = backend.bind(meta, flat)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, flat[slots], k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, flat[slots], v)
    return backend.attend(q, k, v, k_cache, v_cache, meta, scale)


def self_check(backend, device, dtype, num_heads, num_kv_heads, head_dim, block_size) -> str | None:
    """None if `backend` matches `plain` in float32 on every probe step, else why not (naming the part)."""
    for part, plans in probe_plans(block_size).items():
        for plan in plans:
            error = _check_plan(backend, plan, device, dtype, num_heads, num_kv_heads, head_dim, block_size)
            if error is not None:
                return f"{part}: {error}"
    return None


def _check_plan(backend, plan, device, dtype, num_heads, num_kv_heads, head_dim, block_size) -> str | None:
    gen = torch.Generator().manual_seed(0)
    tokens, blocks = sum(plan.counts), sum(len(t) for t in plan.block_tables)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q, k, v = (
        rand(tokens, num_heads, head_dim),
        rand(tokens, num_kv_heads, head_dim),
        rand(tokens, num_kv_heads, head_dim),
    )
    k_cache, v_cache = (
        rand(blocks, block_size, num_kv_heads, head_dim),
        rand(blocks, block_size, num_kv_heads, head_dim),
    )
    scale = head_dim**-0.5
    try:
        want = run_backend(PlainBackend(decode_kernel="padded"), plan, q, k, v, k_cache, v_cache, scale)
        got = run_backend(backend, plan, *(t.to(dtype) for t in (q, k, v, k_cache, v_cache)), scale)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this backend
        return f"{type(exc).__name__}: {exc}"
    err = (got.float() - want).abs().max().item()
    return None if err <= TOLERANCE.get(dtype, 4e-2) else f"max abs error {err:.3g} against plain"
