"""Engine throughput against transformers' own batching, measured in the same run.

Workload: 64 requests, prompts of uniform 8-256 random token ids, outputs of uniform 4-64 tokens with
EOS ignored (so every method generates exactly the same tokens), on a random-weight Llama of about
34M parameters built from a config with a fixed seed (hidden 512, 8 layers, 8 heads, 4 KV heads,
vocab 8192, intermediate 1536). Greedy decoding everywhere.

- HF static: ``model.generate`` on left-padded batches of 16 in the given order; each batch runs for
  its longest request (min = max new tokens) and only each request's own tokens count as useful, which
  is exactly what static batching costs.
- HF generate_batch: transformers' continuous batching. ``generate_batch`` takes one max_new_tokens for
  all requests, so we drive the same manager the way ``generate_batch`` does but add each request with
  its own ``max_new_tokens`` (and EOS disabled). Its setup (cache sizing, warm-up) is reported apart
  and not timed, as model loading is not timed for the others.
- bulkgen: ``Engine.generate`` with ``ignore_eos=True`` and per-request ``max_tokens``.

Goal: bulkgen >= 1.5x HF static and >= 2.5x HF generate_batch output tokens/s.

    python bench/bench_engine.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

GOALS = {"hf_static": 1.5, "hf_generate_batch": 2.5}
FULL = {
    "requests": 64,
    "prompt": (8, 256),
    "output": (4, 64),
    "model": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1536,
        "vocab_size": 8192,
    },
}
QUICK = {
    "requests": 12,
    "prompt": (4, 32),
    "output": (2, 12),
    "model": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
    },
}


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lengths: list[int]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lengths)


def make_workload(
    n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int
) -> Workload:
    """Random token-id prompts and output lengths from a fixed RNG; ids avoid the special tokens."""
    rng = random.Random(seed)
    usable = [i for i in range(vocab) if not 256 <= i <= 260]  # 256..260: the tokenizer's specials
    prompts = [[rng.choice(usable) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(n)])


def build_model(path: Path, model_kwargs: dict, seed: int) -> tuple[Path, int]:
    """A random-weight Llama (fixed seed) plus the bundled byte tokenizer; returns (path, parameters)."""
    from transformers import AutoModelForCausalLM

    from bulkgen.lab.tiny import build_tiny_model

    kwargs = dict(model_kwargs)
    build_tiny_model(path, "llama", seed=seed, max_position_embeddings=1024, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def result(method: str, wall_s: float, useful: int, slot_steps: int | None, **extra) -> dict:
    return {
        "method": method,
        "wall_s": round(wall_s, 4),
        "output_tokens": useful,
        "output_tokens_per_s": round(useful / wall_s, 2) if wall_s > 0 else None,
        "slot_efficiency": round(useful / slot_steps, 4) if slot_steps else None,
        **extra,
    }


def run_hf_static(model, work: Workload, batch_size: int, pad_id: int) -> dict:
    """Left-padded groups in the given order, each run to its longest member's output length."""
    _hf_static_groups(model, Workload(work.prompts[:1], [2]), batch_size, pad_id)  # warm-up
    started = time.perf_counter()
    slot_steps = _hf_static_groups(model, work, batch_size, pad_id)
    return result("hf_static", time.perf_counter() - started, work.useful_tokens, slot_steps)


@torch.no_grad()
def _hf_static_groups(model, work: Workload, batch_size: int, pad_id: int) -> int:
    slot_steps = 0
    for first in range(0, len(work.prompts), batch_size):
        prompts = work.prompts[first : first + batch_size]
        steps = max(work.output_lengths[first : first + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=None,
        )
        if out.shape[1] - width != steps:
            raise RuntimeError(f"HF static generated {out.shape[1] - width} tokens, expected {steps}")
        slot_steps += len(prompts) * steps
    return slot_steps


@torch.no_grad()
def run_hf_generate_batch(model, work: Workload, pad_id: int) -> dict:
    """transformers' continuous batching manager, each request with its own max_new_tokens."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    config = GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=pad_id, max_new_tokens=max(work.output_lengths)
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in work.prompts),
        max_generated_length=max(work.output_lengths),
        num_requests=len(work.prompts),
    )
    setup_started = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=5, workload_hints=hints
    ) as manager:
        started = time.perf_counter()
        for i, (prompt, length) in enumerate(zip(work.prompts, work.output_lengths, strict=True)):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=length, eos_token_id=-1)
        generated = _collect(manager, len(work.prompts))
        wall = time.perf_counter() - started
    if generated != work.useful_tokens:
        raise RuntimeError(f"generate_batch produced {generated} tokens, expected {work.useful_tokens}")
    return result("hf_generate_batch", wall, generated, None, setup_s=round(started - setup_started, 3))


def _collect(manager, count: int, timeout_s: float = 600.0) -> int:
    finished, tokens, deadline = set(), 0, time.monotonic() + timeout_s
    while len(finished) < count:
        if time.monotonic() > deadline or not manager.is_running():
            raise RuntimeError(f"generate_batch stopped with {len(finished)}/{count} requests finished")
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished() and out.request_id not in finished:
            if out.error is not None:
                raise RuntimeError(f"generate_batch request {out.request_id} failed: {out.error}")
            finished.add(out.request_id)
            tokens += len(out.generated_tokens)
    return tokens


def run_bulkgen(path: Path, work: Workload, max_num_seqs: int, max_num_batched_tokens: int) -> dict:
    """bulkgen's engine on the same requests; slot efficiency from its own counters, warm-up excluded."""
    from bulkgen.engine import Engine, EngineConfig, SamplingParams
    from bulkgen.metrics.batch import slot_efficiency

    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    engine = Engine.from_pretrained(str(path), config)
    engine.generate([work.prompts[0]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    before = engine.stats()
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lengths]
    started = time.perf_counter()
    outs = engine.generate(work.prompts, params)
    wall = time.perf_counter() - started
    after = engine.stats()
    generated = sum(len(o.token_ids) for o in outs)
    if generated != work.useful_tokens:
        raise RuntimeError(f"bulkgen produced {generated} tokens, expected {work.useful_tokens}")
    delta = {key: after[key] - before[key] for key in ("slot_steps", "active_slot_steps") if key in after}
    return {**result("bulkgen", wall, generated, None), "slot_efficiency": slot_efficiency(delta)}


def add_ratios(rows: list[dict]) -> None:
    """Throughput ratio of every row against each baseline measured in this run."""
    by_method = {row["method"]: row for row in rows}
    for row in rows:
        for base in GOALS:
            ref = by_method.get(base, {}).get("output_tokens_per_s")
            mine = row.get("output_tokens_per_s")
            row[f"vs_{base}"] = round(mine / ref, 3) if ref and mine else None


def format_rows(rows: list[dict]) -> str:
    from bulkgen.metrics.table import text_table

    def cell(value, fmt):
        return "n/a" if value is None else fmt.format(value)

    table = [["method", "wall s", "out tok/s", "slot eff", "vs HF static", "vs HF generate_batch"]]
    for row in rows:
        table.append(
            [
                row["method"],
                cell(row.get("wall_s"), "{:.2f}"),
                cell(row.get("output_tokens_per_s"), "{:.1f}"),
                cell(row.get("slot_efficiency"), "{:.3f}"),
                cell(row.get("vs_hf_static"), "{:.2f}x"),
                cell(row.get("vs_hf_generate_batch"), "{:.2f}x"),
            ]
        )
    lines = [text_table(table)]
    bulkgen = next((r for r in rows if r["method"] == "bulkgen"), None)
    if bulkgen:
        for base, goal in GOALS.items():
            ratio = bulkgen.get(f"vs_{base}")
            verdict = "met" if ratio is not None and ratio >= goal else "NOT met"
            lines.append(f"goal >= {goal}x {base}: {verdict} ({cell(ratio, '{:.2f}x')})")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run on a tiny model")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--requests", type=int, help="override the number of requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--static-batch", type=int, default=16, help="HF static batch size")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--methods", default="hf_static,hf_generate_batch,bulkgen")
    args = parser.parse_args(argv)
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests must be >= 1, got {args.requests}")
    unknown = set(args.methods.split(",")) - {"hf_static", "hf_generate_batch", "bulkgen"}
    if unknown:
        parser.error(f"--methods: unknown {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Build the model, run every method on the same workload, print and return the results."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    args = parse_args(argv)
    hf_logging.disable_progress_bar()
    spec = QUICK if args.quick else FULL
    work = make_workload(
        args.requests or spec["requests"],
        spec["prompt"],
        spec["output"],
        spec["model"]["vocab_size"],
        args.seed,
    )
    methods = args.methods.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bulkgen-bench-") as tmp:
        path, params = build_model(Path(tmp) / "model", spec["model"], args.seed)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        pad_id = model.config.pad_token_id
        if "hf_static" in methods:
            rows.append(run_hf_static(model, work, args.static_batch, pad_id))
        if "hf_generate_batch" in methods:
            rows.append(run_hf_generate_batch(model, work, pad_id))
        if "bulkgen" in methods:
            rows.append(run_bulkgen(path, work, args.max_num_seqs, args.max_num_batched_tokens))
    add_ratios(rows)
    report = {
        "parameters": params,
        "requests": len(work.prompts),
        "output_tokens": work.useful_tokens,
        "prompt_tokens": sum(len(p) for p in work.prompts),
        "torch_threads": torch.get_num_threads(),
        "results": rows,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"model: {params / 1e6:.1f}M parameters; {report['requests']} requests, "
            f"{report['prompt_tokens']} prompt tokens, {report['output_tokens']} output tokens; "
            f"{report['torch_threads']} torch threads"
        )
        print(format_rows(rows))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
