"""KV-cache bytes per running sequence, computed from the engine's own accounting (no GPU, no weights).

For each model shape (the values of its public config.json), every layer's attention as the engine's
probe finds it (`LayerAttention`: KV heads, K/V head sizes, sliding window) is laid out by the engine's
`KVLayout`, and a `BlockManager` over that layout runs one sequence as the scheduler would: an
8,192-token prompt in one step (a GPU's default step budget is 16,384 tokens), then the window slide
the scheduler makes before the sequence's next step. Reported: the blocks it holds between steps times
the bytes of a block, with every layer kept whole ("before": one full group, what the cache held when
a window limited reading only) and with windowed groups giving back what is behind their window
("after"), and how many such sequences one KV budget (64 GiB of bf16) holds each way. For MLA
(DeepSeek-V3), the bytes per token the cache holds: the compressed latent (kv_lora_rank + the rope
part per token and layer, one KV head: engine/attention/mla.py, as vLLM and SGLang cache it) against K and V of
every head expanded from it (what bulkgen cached before the latent cache), and the sequences one
budget holds each way. And for each cache dtype (`--kv-cache-dtype`: bf16, or FP8
e4m3 with its float32 scale per token and KV head, engine/kv/kv_cache.py): the bytes a token takes over all
layers and how many sequences of `--context` tokens one GiB holds (windows freed, as the engine runs).

    python bench/bench_kv_memory.py [--context 8192] [--budget-gib 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulkgen.engine.attention.layer_attention import FULL, AttnKind, LayerAttention  # noqa: E402
from bulkgen.engine.kv.block_manager import BlockManager  # noqa: E402
from bulkgen.engine.kv.kv_cache import FP8  # noqa: E402
from bulkgen.engine.kv.kv_layout import KVLayout  # noqa: E402
from bulkgen.engine.sampling.sampling_params import SamplingParams  # noqa: E402
from bulkgen.engine.sequence import Request, Sequence  # noqa: E402

BLOCK_SIZE = 16
BF16 = torch.bfloat16
GIB = 1 << 30


def llama_3_8b() -> list[LayerAttention]:
    """meta-llama/Meta-Llama-3-8B: 32 full layers, 8 KV heads of 128."""
    return [LayerAttention(FULL, 8, 128, 128, q_heads=32) for _ in range(32)]


def gpt_oss_20b() -> list[LayerAttention]:
    """openai/gpt-oss-20b: 24 layers alternating sliding (128 tokens) and full, 8 KV heads of 64."""
    window = AttnKind(window=128)
    return [LayerAttention(window if i % 2 == 0 else FULL, 8, 64, 64, sinks=True) for i in range(24)]


def gemma_3_27b() -> list[LayerAttention]:
    """google/gemma-3-27b: 62 layers, five sliding (1,024 tokens) to one full, 16 KV heads of 128."""
    window = AttnKind(window=1024)
    return [LayerAttention(FULL if (i + 1) % 6 == 0 else window, 16, 128, 128) for i in range(62)]


def deepseek_v3(latent: bool = True) -> list[LayerAttention]:
    """deepseek-ai/DeepSeek-V3: 61 layers of MLA, 128 heads; cached as the latent, one KV head of 576
    (kv_lora_rank 512 + 64 rope, V its first 512), or expanded: 128 K heads of 192, V heads of 128."""
    if latent:
        return [LayerAttention(FULL, 1, 512 + 64, 512, q_heads=128, latent=True) for _ in range(61)]
    return [LayerAttention(FULL, 128, 192, 128, q_heads=128) for _ in range(61)]


def held_bytes(
    layout: KVLayout, context: int, step_tokens: int = 16384, dtype: torch.dtype = BF16
) -> tuple[int, int]:
    """(blocks, bytes) one sequence of `context` tokens holds between steps, from the block manager, in a
    cache of `dtype`."""
    bm = BlockManager(1 << 24, BLOCK_SIZE, enable_prefix_caching=False, kinds=layout.kinds)
    request = Request("r", list(range(context)), SamplingParams(max_tokens=1), order=0)
    seq = Sequence(0, request, 0, max_tokens=1)
    while seq.num_computed_tokens < context:
        bm.slide(seq)
        end = min(seq.num_computed_tokens + step_tokens, context)
        if not (bm.grow(seq, end) if seq.block_tables else bm.admit(seq, None, end)):
            raise RuntimeError("the block pool is too small for one sequence")
        seq.num_computed_tokens = end
    bm.slide(seq)  # what the scheduler does before the sequence's next step
    blocks = sum(b != bm.null_block for table in seq.block_tables for b in table)
    return blocks, blocks * layout.block_bytes(BLOCK_SIZE, dtype)


def dtype_row(name: str, layers: list[LayerAttention], context: int) -> dict:
    """Bytes per token (every layer) and sequences of `context` tokens per GiB, bf16 against FP8."""
    layout, row = KVLayout(layers), {"model": name, "context": context}
    for label, dtype in (("bf16", BF16), ("fp8", FP8)):
        held = held_bytes(layout, context, dtype=dtype)[1]
        row[f"{label}_bytes_per_token"] = layout.token_bytes(dtype)
        row[f"{label}_seq_bytes"], row[f"{label}_seqs_per_gib"] = held, round(GIB / held, 2)
    row["ratio"] = round(row["bf16_seq_bytes"] / row["fp8_seq_bytes"], 3)
    return row


def windows_row(name: str, layers: list[LayerAttention], context: int, budget: int) -> dict:
    before, after = KVLayout(layers, by_kind=False), KVLayout(layers)
    (blocks_b, bytes_b), (blocks_a, bytes_a) = held_bytes(before, context), held_bytes(after, context)
    return {
        "model": name,
        "context": context,
        "groups": _groups(after),
        "before_blocks": blocks_b,
        "before_bytes": bytes_b,
        "after_blocks": blocks_a,
        "after_bytes": bytes_a,
        "ratio": round(bytes_b / bytes_a, 2),
        "budget_gib": budget >> 30,
        "seqs_before": budget // bytes_b,
        "seqs_after": budget // bytes_a,
    }


def _groups(layout: KVLayout) -> str:
    """'12 full layers in 1 group, 52 sliding window 1024 layers in 6 groups' and so on."""
    kinds: dict[str, list[int]] = {}
    for group in layout.groups:
        kinds.setdefault(str(group.kind), []).append(len(group.layers))
    return ", ".join(f"{sum(n)} x {kind} in {len(n)} group{'s' * (len(n) > 1)}" for kind, n in kinds.items())


def mla_row(context: int, budget: int) -> dict:
    latent, expanded = KVLayout(deepseek_v3()), KVLayout(deepseek_v3(latent=False))
    return {
        "model": "DeepSeek-V3 (MLA)",
        "bytes_per_token_latent": latent.token_bytes(BF16),
        "bytes_per_token_expanded": expanded.token_bytes(BF16),
        "ratio": round(expanded.token_bytes(BF16) / latent.token_bytes(BF16), 1),
        "seqs_latent": budget // held_bytes(latent, context)[1],
        "seqs_expanded": budget // held_bytes(expanded, context)[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--budget-gib", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    budget = args.budget_gib << 30
    rows = [
        windows_row("gpt-oss-20b", gpt_oss_20b(), args.context, budget),
        windows_row("Gemma-3-27B", gemma_3_27b(), args.context, budget),
    ]
    mla = mla_row(args.context, budget)
    shapes = [("Llama-3-8B", llama_3_8b()), ("gpt-oss-20b", gpt_oss_20b()), ("Gemma-3-27B", gemma_3_27b())]
    dtypes = [dtype_row(name, layers, args.context) for name, layers in shapes]
    if args.json:
        print(json.dumps({"windows": rows, "mla": mla, "kv_dtypes": dtypes}, indent=2))
        return
    mib = 1 << 20
    print(f"KV bytes per running sequence at {args.context:,} tokens (bf16, {BLOCK_SIZE}-token blocks)")
    print(
        f"{'model':14} {'all layers full':>16} {'window freeing':>16} {'ratio':>6}  sequences in {args.budget_gib} GiB"
    )
    for r in rows:
        print(
            f"{r['model']:14} {r['before_bytes'] / mib:>12.1f} MiB {r['after_bytes'] / mib:>12.1f} MiB "
            f"{r['ratio']:>5}x  {r['seqs_before']:,} -> {r['seqs_after']:,}   ({r['groups']})"
        )
    print(
        f"{mla['model']}: {mla['bytes_per_token_latent']:,} bytes per token cached (the latent), "
        f"{mla['bytes_per_token_expanded']:,} with K and V expanded ({mla['ratio']}x more); "
        f"sequences of {args.context:,} tokens in {args.budget_gib} GiB: "
        f"{mla['seqs_expanded']:,} expanded -> {mla['seqs_latent']:,}"
    )
    print(f"\nKV cache dtype: bytes per token (all layers) and sequences of {args.context:,} tokens per GiB")
    print(
        f"{'model':14} {'bf16 B/token':>13} {'fp8 B/token':>12} {'bf16 seq/GiB':>13} {'fp8 seq/GiB':>12} ratio"
    )
    for r in dtypes:
        print(
            f"{r['model']:14} {r['bf16_bytes_per_token']:>13,} {r['fp8_bytes_per_token']:>12,} "
            f"{r['bf16_seqs_per_gib']:>13} {r['fp8_seqs_per_gib']:>12} {r['ratio']}x"
        )


if __name__ == "__main__":
    main()
