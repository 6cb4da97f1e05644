"""How many sequences at 8k context a GiB of cache holds: Qwen3-Next-80B's shape (48 layers, 1 in 4 full
attention, 36 Gated DeltaNet layers) against a dense model of the same layers, all full attention.

Computed from the engine's own accounting, no GPU: the model is built on the meta device from
transformers' Qwen3NextConfig defaults (which are Qwen3-Next-80B-A3B's values), the engine finds its
attention layers and recurrent mixers and probes each mixer's per-sequence state (hybrid_layers), and
`kv_cache_blocks` splits a cache budget between state slots and KV blocks as the engine does. For the
hybrid model the best `num_state_slots` is searched (slots and blocks running out together); the state
dtypes are those transformers' torch path stores (bf16 conv state, fp32 recurrent state).

    python bench/bench_hybrid_memory.py [--context 8192] [--budget-gib 80] [--block-size 16]
"""

from __future__ import annotations

import argparse

import torch

GIB = 1 << 30


def _model(all_attention: bool):
    import transformers

    config = transformers.Qwen3NextConfig()
    if all_attention:
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    with torch.device("meta"):
        return transformers.Qwen3NextForCausalLM(config).to(torch.bfloat16), config


def _held(model, config, context: int, budget: int, block_size: int) -> dict:
    """Sequences of `context` tokens held in `budget` bytes, by the engine's accounting."""
    from bulkgen.engine.config import EngineConfig
    from bulkgen.engine.features.hybrid_layers import attention_layers, find_mixers, probe_states
    from bulkgen.engine.features.state_slots import slot_bytes
    from bulkgen.engine.model_runner import kv_block_bytes, kv_cache_blocks

    mixers = find_mixers(model)
    attn = attention_layers(model)
    per_slot = slot_bytes(probe_states(mixers, config.hidden_size)) if mixers else 0
    block = kv_block_bytes(len(attn), block_size, config.num_key_value_heads, config.head_dim, torch.bfloat16)
    blocks_per_seq = -(-context // block_size)

    def held(slots: int) -> int:
        cfg = EngineConfig(kv_cache_bytes=budget, max_num_seqs=slots, block_size=block_size)
        reserved = (slots + 1) * per_slot if mixers else 0
        if reserved >= budget:
            return 0
        blocks = kv_cache_blocks(cfg, torch.device("cpu"), block, blocks_per_seq, reserved)
        return min(slots, blocks // blocks_per_seq)

    best = max(range(1, budget // (blocks_per_seq * block) + 2), key=held)
    return {
        "attention layers": len(attn),
        "recurrent layers": len(mixers),
        "KV bytes/token": block // block_size,
        "state bytes/sequence": per_slot,
        "sequences": held(best),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--budget-gib", type=int, default=80)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    budget = args.budget_gib * GIB
    rows = {}
    for name, dense in (("Qwen3-Next-80B shape (hybrid)", False), ("same, all full attention", True)):
        model, config = _model(dense)
        rows[name] = _held(model, config, args.context, budget, args.block_size)
    print(
        f"cache budget {args.budget_gib} GiB, {args.context}-token sequences, block {args.block_size}, bf16"
    )
    for name, row in rows.items():
        per_gib = row["sequences"] / args.budget_gib
        per_seq_mib = (row["KV bytes/token"] * args.context + row["state bytes/sequence"]) / (1 << 20)
        print(
            f"{name}: {row['attention layers']} attention + {row['recurrent layers']} recurrent layers, "
            f"KV {row['KV bytes/token'] / 1024:.0f} KiB/token, state {row['state bytes/sequence'] / (1 << 20):.2f} "
            f"MiB/sequence, {per_seq_mib:.0f} MiB/sequence at {args.context}: {row['sequences']} sequences, "
            f"{per_gib:.2f} per GiB"
        )
    hybrid, dense = (r["sequences"] for r in rows.values())
    print(f"ratio hybrid / dense: {hybrid / dense:.2f}x")


if __name__ == "__main__":
    main()
