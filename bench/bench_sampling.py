"""Cost of sampling against greedy decoding on CPU, measured in the same run (goal <= 1.3x).

Workload: a random-weight Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1536) with a
32,000-token vocabulary, 48 requests with prompts of 8-64 random tokens and 32 output tokens each, EOS
off; decoded greedily, then with temperature 0.8, top_p 0.95 and a seed per request, on one engine.
Random weights give near-flat next-token distributions, the hardest case for top-p (the nucleus is
most of the vocabulary).

    OMP_NUM_THREADS=2 python bench/bench_sampling.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

GOAL = 1.3
FULL = {
    "requests": 48,
    "prompt": (8, 64),
    "output": 32,
    "repeats": 2,
    "model": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1536,
        "vocab_size": 32000,
    },
}
QUICK = {
    "requests": 8,
    "prompt": (4, 16),
    "output": 8,
    "repeats": 1,
    "model": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 32000,
    },
}


def run(spec: dict, seed: int = 0) -> dict:
    from bulkgen.engine import Engine, SamplingParams
    from bulkgen.lab.tiny import build_tiny_model

    rng = random.Random(seed)
    vocab = spec["model"]["vocab_size"]
    prompts = [
        [rng.randrange(261, vocab) for _ in range(rng.randint(*spec["prompt"]))]
        for _ in range(spec["requests"])
    ]
    with tempfile.TemporaryDirectory(prefix="bulkgen-bench-sampling-") as tmp:
        path = build_tiny_model(Path(tmp) / "model", "llama", seed=seed, **spec["model"])
        engine = Engine.from_pretrained(str(path), device="cpu")
    greedy = SamplingParams(max_tokens=spec["output"], temperature=0.0, ignore_eos=True)
    sampled = [
        SamplingParams(max_tokens=spec["output"], temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    engine.generate(prompts[:2], greedy)  # warm-up
    times: dict[str, list[float]] = {"greedy": [], "sampled": []}
    for _ in range(spec["repeats"]):  # interleaved, so load from other processes hits both alike
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            started = time.perf_counter()
            outs = engine.generate(prompts, params)
            times[name].append(time.perf_counter() - started)
            assert sum(len(o.token_ids) for o in outs) == spec["output"] * len(prompts)
    best = {name: min(values) for name, values in times.items()}
    return {
        "vocab_size": vocab,
        "requests": len(prompts),
        "output_tokens": spec["output"] * len(prompts),
        "torch_threads": torch.get_num_threads(),
        "greedy_s": round(best["greedy"], 3),
        "sampled_s": round(best["sampled"], 3),
        "ratio": round(best["sampled"] / best["greedy"], 3),
        "goal": GOAL,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model, seconds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = run(QUICK if args.quick else FULL)
    if args.json:
        print(json.dumps(report))
    else:
        verdict = "met" if report["ratio"] <= GOAL else "NOT met"
        print(
            f"vocab {report['vocab_size']}, {report['requests']} requests, {report['output_tokens']} output "
            f"tokens, {report['torch_threads']} torch threads"
        )
        print(
            f"greedy {report['greedy_s']:.2f} s, sampled (T 0.8, top_p 0.95) {report['sampled_s']:.2f} s: "
            f"sampled/greedy {report['ratio']:.2f}x (goal <= {GOAL}x: {verdict})"
        )
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
