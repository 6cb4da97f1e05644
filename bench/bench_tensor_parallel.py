"""Per-rank memory and step time of one tiny model at tensor_parallel 1 and 2 on CPU (gloo ranks of one
torch thread each): what a rank holds, what loading it costs, and what the collectives add to a step.

On CPU the ranks share the machine's cores and pay two all-reduces per layer over loopback, so tp=2 is
not expected to be faster here; the figures show each rank holding half the weights and the KV heads,
and the per-step cost of the collectives (the step-time ratio, measured in one run).

    python bench/bench_tensor_parallel.py [--layers 8] [--hidden 512] [--prompts 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MIB = 1 << 20


def build(path: Path, layers: int, hidden: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from bulkgen.lab.tiny import build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="10MB")
    tok.save_pretrained(path)
    return path


def run(path: Path, tp: int, prompts: list[list[int]], max_tokens: int) -> dict:
    """Load at `tp` ranks, generate, and return per-rank memory and the mean step wall time."""
    from bulkgen.engine import Engine, SamplingParams
    from bulkgen.engine.parallel.tensor_parallel import RankGroup, load_shard

    kwargs = dict(device="cpu", num_kv_blocks=512, tensor_parallel=tp)
    if tp > 1:
        engine = Engine.from_pretrained(str(path), **kwargs)
        ranks = engine.runner.tp.rank_memory()
    else:  # the whole model through the same loader as a rank's, in a group of one, then a plain engine
        group = RankGroup.join("127.0.0.1", 0, 0, 1, "cpu", 60)
        del kwargs["tensor_parallel"]
        load_shard(path, group, torch.float32)
        ranks = group.rank_memory()
        engine = Engine.from_pretrained(str(path), **kwargs)
    kv = engine.runner.k_caches[0].shape[-2]
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    wall = time.perf_counter() - start
    engine.close()
    tokens = [o.outputs[0].token_ids for o in outs]
    return {"tp": tp, "ranks": ranks, "kv_heads": kv, "wall": wall, "tokens": tokens}


def measure(path: Path, tp: int, args) -> dict:
    """`run` in a fresh interpreter: a load's peak is then not hidden by memory this process freed."""
    spec = json.dumps({"path": str(path), "tp": tp, "prompts": args.prompts, "max_tokens": args.max_tokens})
    done = subprocess.run(
        [sys.executable, __file__, "--child", spec], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(spec: str) -> None:
    spec = json.loads(spec)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (64,), generator=gen).tolist() for _ in range(spec["prompts"])]
    print(json.dumps(run(Path(spec["path"]), spec["tp"], prompts, spec["max_tokens"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp) / "model", args.layers, args.hidden)
        results = [measure(path, tp, args) for tp in (1, 2)]
    steps = args.max_tokens  # one prefill step and max_tokens - 1 decodes (every prompt fits one step)
    print(f"{'tp':>3} {'rank':>5} {'weights MiB':>12} {'load peak +MiB':>15} {'KV heads':>9} {'step ms':>8}")
    for res in results:
        for rank in res["ranks"]:
            grown = (rank["peak_rss"] - rank["rss_before"]) / MIB
            step_ms = 1000 * res["wall"] / steps
            print(
                f"{res['tp']:>3} {rank['rank']:>5} {rank['weight_bytes'] / MIB:>12.1f} {grown:>15.1f} "
                f"{res['kv_heads']:>9} {step_ms:>8.2f}"
            )
    same = results[0]["tokens"] == results[1]["tokens"]
    print(
        f"step time tp=2 / tp=1: {results[1]['wall'] / results[0]['wall']:.2f}; greedy tokens equal: {same}"
    )


if __name__ == "__main__":
    main()
