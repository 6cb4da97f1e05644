"""The paged decode kernel's launch choices on the GPU, each against the default measured in the same run.

bulkgen/engine/attention/triton_decode.py reads `tile_tokens` K/V rows per loop iteration (whole blocks),
launches `num_warps` warps a program and splits each sequence until about `target_programs` programs run.
This times each combination on two decode shapes in bf16 (blocks of 16 rows, 8 KV heads, GQA 4:1, head
size 64, the anchor model's): the anchor's (512 sequences, contexts 64-1,536) and a long-context one (64
sequences, 1,024-8,192). Each row: ms per layer (CUDA events, median of 20 after 3 warm-ups), the ratio
to the default, the real K/V bytes read per second, and the largest difference from the padded path's
output (the reference every kernel is checked against). FlashAttention's varlen kernel over the same
rows stored contiguously is the bandwidth reference. Installs nothing; needs CUDA and triton.

    python3 bench/gpu_decode_tiles.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from bulkgen.engine.attention import triton_decode  # noqa: E402
from bulkgen.engine.attention.attn_backends import DecodeMeta, paged_decode  # noqa: E402

SHAPES = {"anchor": (512, 64, 1536), "long": (64, 1024, 8192)}  # sequences, shortest, longest context
BLOCK, HKV, GROUP, DIM = 16, 8, 4, 64
GRID = {"tile_tokens": (16, 32, 64, 128), "num_warps": (2, 4, 8), "target_programs": (264, 528, 1056)}
DEFAULT = {
    "tile_tokens": triton_decode._TILE_TOKENS,
    "num_warps": triton_decode._NUM_WARPS,
    "target_programs": triton_decode._TARGET_PROGRAMS,
}


def cuda_ms(call, repeats: int = 20) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def shape_case(batch: int, low: int, high: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = -(-high // BLOCK)
    k_cache = torch.randn(
        batch * width + 1, BLOCK, HKV, DIM, device="cuda", dtype=torch.bfloat16, generator=gen
    )
    v_cache = torch.randn(k_cache.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(batch * width, device="cuda", generator=gen).view(batch, width)
    lengths = torch.randint(low, high + 1, (batch,), device="cuda", generator=gen)
    q = torch.randn(batch, HKV * GROUP, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k_cache, v_cache, table, lengths


def flash_reference_ms(q, lengths) -> float | None:
    batch, real = q.shape[0], int(lengths.sum())
    kv = torch.randn(real, HKV, DIM, device="cuda", dtype=torch.bfloat16)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    cu_k[1:] = lengths.cumsum(0)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    longest = int(lengths.max())
    try:
        return cuda_ms(
            lambda: torch.ops.aten._flash_attention_forward(
                q, kv, kv, cu_q, cu_k, 1, longest, 0.0, False, False, scale=DIM**-0.5
            )[0]
        )
    except RuntimeError as exc:  # a torch without the flash kernel
        print(f"flash reference unavailable: {exc}")
        return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--budget-s", type=float, default=150.0, help="stop sweeping after this long (shared by the shapes)"
    )
    args = parser.parse_args(argv)
    assert torch.cuda.is_available() and triton_decode.available(), "needs CUDA and triton"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "default": DEFAULT}
    for name, (batch, low, high) in SHAPES.items():
        q, k_cache, v_cache, table, lengths = shape_case(batch, low, high)
        gb = int(lengths.sum()) * HKV * DIM * 2 * 2 / 1e9
        meta = DecodeMeta(0, batch, table, lengths)
        want = paged_decode(q, k_cache, v_cache, meta, DIM**-0.5, "padded").float()
        rows, began = [], time.monotonic()
        combos = [DEFAULT] + [dict(zip(GRID, c, strict=True)) for c in itertools.product(*GRID.values())]
        for tuning in combos:
            if time.monotonic() - began > args.budget_s / len(SHAPES):
                rows.append({"stopped": "budget spent"})
                break

            call = functools.partial(
                triton_decode.paged_decode, q, k_cache, v_cache, table, lengths, DIM**-0.5, tuning=tuning
            )
            err = (call().float() - want).abs().max().item()
            ms = cuda_ms(call)
            rows.append({**tuning, "ms": round(ms, 4), "tb_per_s": round(gb / ms, 3), "max_err": err})
        base = rows[0]["ms"]
        for row in rows:
            if "ms" in row:
                row["vs_default"] = round(base / row["ms"], 3)
        timed = [r for r in rows[1:] if "ms" in r]
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        report[name] = {
            "batch": batch,
            "contexts": [low, high],
            "real_kv_gb": round(gb, 3),
            "flash_varlen_ms": flash_reference_ms(q, lengths),
            "default": rows[0],
            "best": best,
            "rows": rows,
        }
        print(f"{name}: default {rows[0]}; best {best}; flash {report[name]['flash_varlen_ms']}", flush=True)
        (out / "gpu-decode-tiles.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
