"""The reference workload on one GPU: transformers' static batches against bulkgen, greedy and sampled.

Workload (fixed seed): a random-weight model of the Llama-3.2-1B shape (hidden 2048, intermediate
8192, 16 layers, 32 heads, 8 KV heads, vocab 128256, tied embeddings, rope_theta 500000) in bf16;
512 requests with uniform 16-1024 random prompt tokens and uniform 8-256 output tokens, EOS off.

- hf_static: `model.generate` on left-padded batches of 64 in input order, each run to its longest
  member's output length (useful tokens = each request's own); greedy.
- bulkgen_greedy / bulkgen_sampled: `Engine.generate` on the same requests (sampled: temperature 0.8,
  top_p 0.95, seed = request index), defaults sized from free GPU memory. Engine setup (attention
  self-check, a warm-up, capturing the decode CUDA graphs for the workload's context lengths) is
  reported as setup_s and not timed, as model loading is not timed for transformers.

Prints a table (wall s, output tok/s, slot efficiency, ratio to static, ratio to the compute floor)
and writes JSON to --out DIR. The compute floor is the workload's matmul + attention FLOPs at the
GPU's dense bf16 peak (--peak-tflops, 989 for an H200; the H200's measured 787 gives a 1.26x higher floor).
The JSON is rewritten after every phase, so a crash late in the run keeps what was measured. Greedy bulkgen is compared token by token
with hf_static (first-divergence statistics: bf16 on both sides, so late divergences are expected).
Installs nothing; `--quick` runs a tiny fp32 model on CPU in seconds (a smoke test of the script).

    python3 bench/gpu.py --out bench/results            # on the GPU, < 8 minutes on an H200
    python3 bench/gpu.py --quick --out /tmp/gpu-smoke   # anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# The GPU machine has the repo but no install of it: import bulkgen from this checkout.
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_engine import _hf_static_groups, make_workload  # noqa: E402

from bulkgen.engine.attention.attn_backends import SDPA_CHOICES  # noqa: E402

ANCHOR = {
    "requests": 512,
    "prompt": (16, 1024),
    "output": (8, 256),
    "static_batch": 64,
    "dtype": "bfloat16",
    "model": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        head_dim=64,
    ),
}
QUICK = {
    "requests": 12,
    "prompt": (4, 40),
    "output": (2, 12),
    "static_batch": 4,
    "dtype": "float32",
    "model": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        max_position_embeddings=2048,
        head_dim=16,
    ),
}
ISSUE_REFERENCE = {"hf_static_greedy_s": 55.0, "hf_continuous_s": 75.1, "floor_s": 1.06}


def build_model(spec: dict, device: str, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from bulkgen.lab.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        **spec["model"],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, spec["dtype"])).eval()
    return model, tokenizer


def workload_flops(spec: dict, work) -> float:
    """Matmul FLOPs (2 x non-embedding params per token, lm_head per output token) plus causal attention."""
    m = spec["model"]
    h, layers, inter = m["hidden_size"], m["num_hidden_layers"], m["intermediate_size"]
    kv = m["num_key_value_heads"] * m["head_dim"]
    per_token = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) * 2
    tokens = sum(len(p) + n for p, n in zip(work.prompts, work.output_lengths, strict=True))
    lm_head = 2 * h * m["vocab_size"] * work.useful_tokens
    pairs = sum((len(p) + n) ** 2 / 2 for p, n in zip(work.prompts, work.output_lengths, strict=True))
    attention = 4 * m["num_attention_heads"] * m["head_dim"] * layers * pairs
    return per_token * tokens + lm_head + attention


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_hf_static(model, work, batch: int, pad_id: int, device: str) -> tuple[dict, list[list[int]]]:
    model_device = next(model.parameters()).device

    class OnDevice:  # _hf_static_groups builds CPU tensors; move them to the model's device
        def generate(self, **kw):
            return model.generate(
                **{k: v.to(model_device) if torch.is_tensor(v) else v for k, v in kw.items()}
            )

    outputs: list[list[int]] = []
    _hf_static_groups(OnDevice(), type(work)(work.prompts[:2], [2, 2]), batch, pad_id)  # warm-up
    sync(device)
    started = time.perf_counter()
    slot_steps = _hf_static_groups(_Recorder(OnDevice(), outputs, work), work, batch, pad_id)
    sync(device)
    wall = time.perf_counter() - started
    return {
        "method": "hf_static",
        "wall_s": wall,
        "output_tokens": work.useful_tokens,
        "slot_efficiency": work.useful_tokens / slot_steps,
    }, outputs


class _Recorder:
    """Keeps each request's own output tokens from the left-padded static batches (untimed cost: a
    .tolist() per batch, which generate's own loop syncs on anyway)."""

    def __init__(self, model, outputs: list[list[int]], work):
        self.model, self.outputs, self.work = model, outputs, work

    def generate(self, input_ids, **kw):
        out = self.model.generate(input_ids=input_ids, **kw)
        first = len(self.outputs)
        for row, ids in enumerate(out[:, input_ids.shape[1] :].tolist()):
            self.outputs.append(ids[: self.work.output_lengths[first + row]])
        return out


def run_bulkgen(engine, work, sampled: bool, device: str) -> tuple[dict, list[list[int]]]:
    from bulkgen.engine import SamplingParams

    def params(i, n):
        if sampled:
            return SamplingParams(max_tokens=n, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    engine.reset()  # a cold prefix cache: a warm one would serve nearly every prompt token of a repeat run
    before = engine.stats()
    sync(device)
    started = time.perf_counter()
    outs = engine.generate(work.prompts, [params(i, n) for i, n in enumerate(work.output_lengths)])
    sync(device)
    wall = time.perf_counter() - started
    after = engine.stats()
    tokens = [o.token_ids for o in outs]
    if sum(map(len, tokens)) != work.useful_tokens:
        raise RuntimeError(f"bulkgen produced {sum(map(len, tokens))} tokens, expected {work.useful_tokens}")
    slots = after["slot_steps"] - before["slot_steps"]
    active = after["active_slot_steps"] - before["active_slot_steps"]
    name = "bulkgen_sampled" if sampled else "bulkgen_greedy"
    return {
        "method": name,
        "wall_s": wall,
        "output_tokens": work.useful_tokens,
        "slot_efficiency": active / slots if slots else None,
        "steps": after["steps"] - before["steps"],
        "cached_prompt_tokens": after["cached_prompt_tokens"] - before["cached_prompt_tokens"],
    }, tokens


def warm_up(engine, work) -> dict:
    """Untimed, before the timed runs: a prefill, then a mixed step (new prompts' prefill beside running
    decodes), graph decodes, greedy and sampled rows, so every kernel specialisation the timed runs use is
    compiled here (a prefill-only warm-up left the mixed step's packed-path kernels to the timed greedy
    run). Returns its step counts."""
    from bulkgen.engine import SamplingParams

    def params(i: int) -> SamplingParams:
        sampled = dict(temperature=0.8, top_p=0.95, seed=i) if i % 2 else dict(temperature=0.0)
        return SamplingParams(max_tokens=8, ignore_eos=True, **sampled)

    prompts = work.prompts[:16]
    engine.pop_step_records()
    for i, prompt in enumerate(prompts[:8]):
        engine.add_request(f"warm{i}", prompt, params(i))
    while engine.scheduler.num_waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()  # through the first half's prefill: from here on they decode
    for i, prompt in enumerate(prompts[8:], start=8):
        engine.add_request(f"warm{i}", prompt, params(i))
    while engine.has_unfinished():
        engine.step()
    records = engine.pop_step_records()
    mixed = sum(bool(r["prefill_tokens"] and r["decode_tokens"]) for r in records)
    return {"steps": len(records), "mixed_steps": mixed}


class Phases:
    """Wall seconds of each phase, in the report and, as each ends, a line of the device run's phases.txt
    (GPU_CHECK_PHASES, set by gpu_check.sh): a run cut off by its timeout still shows where the time went."""

    def __init__(self, report: dict) -> None:
        self.report = report.setdefault("phases_s", {})
        self.path = os.environ.get("GPU_CHECK_PHASES")

    @contextlib.contextmanager
    def __call__(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.report[name] = round(time.perf_counter() - started, 2)
            if self.path:
                with open(self.path, "a") as f:
                    f.write(f"  gpu.py {name} wall_s={self.report[name]}\n")


def divergence(reference: list[list[int]], candidate: list[list[int]]) -> dict:
    """First position where each request's tokens differ (its length when they never do)."""
    firsts = [
        next((i for i, (a, b) in enumerate(zip(r, c, strict=True)) if a != b), len(r))
        for r, c in zip(reference, candidate, strict=True)
    ]
    exact = sum(f == len(r) for f, r in zip(firsts, reference, strict=True))
    diverged = [f for f, r in zip(firsts, reference, strict=True) if f < len(r)]
    return {
        "requests": len(firsts),
        "identical": exact,
        "identical_share": round(exact / len(firsts), 4),
        "first_divergence_min": min(diverged, default=None),
        "first_divergence_median": statistics.median(diverged) if diverged else None,
    }


def finish_rows(rows: list[dict], floor_s: float) -> None:
    static = next((r for r in rows if r["method"] == "hf_static"), None)
    for row in rows:
        row["output_tokens_per_s"] = round(row["output_tokens"] / row["wall_s"], 1)
        row["vs_static"] = round(static["wall_s"] / row["wall_s"], 2) if static else None
        row["vs_floor"] = round(row["wall_s"] / floor_s, 2)
        row["wall_s"] = round(row["wall_s"], 3)


def format_table(rows: list[dict]) -> str:
    head = ["method", "wall s", "out tok/s", "slot eff", "x static", "x floor"]
    lines = [head] + [
        [
            r["method"],
            f"{r['wall_s']:.2f}",
            f"{r['output_tokens_per_s']:.0f}",
            "n/a" if r["slot_efficiency"] is None else f"{r['slot_efficiency']:.3f}",
            "n/a" if r["vs_static"] is None else f"{r['vs_static']:.2f}",
            f"{r['vs_floor']:.2f}",
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for the JSON result")
    parser.add_argument("--quick", action="store_true", help="tiny fp32 model on CPU: a smoke test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU")
    parser.add_argument("--skip-static", action="store_true", help="bulkgen only (the baseline takes ~55 s)")
    parser.add_argument(
        "--profile", action="store_true", help="also write a torch.profiler table of 30 steps"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from bulkgen.engine import Engine

    args = parse_args(argv)
    spec = QUICK if args.quick else ANCHOR
    device = "cpu" if args.quick or not torch.cuda.is_available() else "cuda"
    work = make_workload(
        spec["requests"], spec["prompt"], spec["output"], spec["model"]["vocab_size"], args.seed
    )
    model, tokenizer = build_model(spec, device, args.seed)
    floor_s = workload_flops(spec, work) / (args.peak_tflops * 1e12)
    rows, report = (
        [],
        {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__,
            "quick": args.quick,
            "requests": len(work.prompts),
            "prompt_tokens": sum(map(len, work.prompts)),
            "output_tokens": work.useful_tokens,
            "floor_s": round(floor_s, 4),
            "issue_reference": ISSUE_REFERENCE,
        },
    )
    report["results"] = rows
    phases = Phases(report)
    save = _saver(
        Path(args.out), f"gpu-{report['date'][:10]}{'-quick' if args.quick else ''}.json", report, floor_s
    )
    static_tokens = None
    if not args.skip_static:
        with phases("hf_static"):
            row, static_tokens = run_hf_static(
                model, work, spec["static_batch"], tokenizer.pad_token_id, device
            )
        rows.append(row)
        save()
    if device == "cuda":
        torch.cuda.empty_cache()
    started = time.perf_counter()
    with phases("engine setup"):
        engine = Engine(model, tokenizer)  # the backend's self-check and the decode graphs' capture
    with phases("warm-up"):
        report["warm_up"] = warm_up(engine, work)
    graphs = engine.runner.graphs
    max_context = max(len(p) + n for p, n in zip(work.prompts, work.output_lengths, strict=True))
    with phases("capture"):  # untimed, as at startup (with the paged kernel: nothing new to capture)
        report["decode_buckets"] = graphs.capture(max_context) if graphs is not None else 0
    report["engine"] = {
        "setup_s": round(time.perf_counter() - started, 2),
        "attention": engine.runner.backend.name,
        "max_num_seqs": engine.config.max_num_seqs,
        "kv_blocks": engine.runner.num_blocks,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "attention_probe": getattr(engine.runner.backend, "probe_report", None),
    }
    save()
    with phases("bulkgen greedy"):
        row, greedy_tokens = run_bulkgen(engine, work, sampled=False, device=device)
    rows.append(row)
    if static_tokens is not None:
        report["greedy_vs_hf_static"] = divergence(static_tokens, greedy_tokens)
    save()
    with phases("bulkgen sampled"):
        rows.append(run_bulkgen(engine, work, sampled=True, device=device)[0])
    save()
    # the same greedy run with overlapped steps flipped (off on CUDA, where they are the default; on, on
    # CPU): what overlapping the host's work with the device's gains, and that it changes no token
    default, engine.overlap = engine.overlap, not engine.overlap
    with phases("bulkgen greedy, overlap flipped"):
        other, other_tokens = run_bulkgen(engine, work, sampled=False, device=device)
    engine.overlap = default
    other["method"] = "bulkgen_greedy_overlapped" if default is False else "bulkgen_greedy_step_by_step"
    rows.append(other)
    report["greedy_overlapped_vs_step_by_step"] = divergence(other_tokens, greedy_tokens)
    report["sdpa_kernels"] = dict(SDPA_CHOICES)  # which SDPA kernel each call site ran, under the pin
    save()
    if args.profile:
        report["profile"] = profile_steps(engine, work, Path(args.out), device)
    final = save()
    path = final.pop("path")
    print(
        f"{report['device']}, torch {report['torch']}: {report['requests']} requests, {report['prompt_tokens']} "
        f"prompt / {report['output_tokens']} output tokens; floor {floor_s:.2f} s; engine {report['engine']}"
    )
    print(format_table(final["results"]))
    if "greedy_vs_hf_static" in report:
        print(f"greedy bulkgen vs hf_static: {report['greedy_vs_hf_static']}")
    print(f"greedy overlapped vs step by step: {report['greedy_overlapped_vs_step_by_step']}")
    print(f"wrote {path}")
    return final


def _saver(out: Path, name: str, report: dict, floor_s: float):
    """-> save(): write the report as it stands (its rows finished on a copy, so timings stay raw)
    and return that copy."""

    def save() -> dict:
        done = json.loads(json.dumps(report))
        finish_rows(done["results"], floor_s)
        out.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(done, indent=2) + "\n")
        done["path"] = str(out / name)
        return done

    return save


def profile_steps(engine, work, out: Path, device: str) -> str:
    """30 steps of a sampled run under torch.profiler; the op table goes to out/profile-*.txt."""
    from torch.profiler import ProfilerActivity, profile

    from bulkgen.engine import SamplingParams

    for i, prompt in enumerate(work.prompts[:256]):
        engine.add_request(
            f"p{i}",
            prompt,
            SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True),
        )
    for _ in range(10):  # past the prefill-heavy start
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(30):
            engine.step()
        sync(device)
    engine.reset()
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=40)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "profile-sampled-30-steps.txt"
    path.write_text(table)
    return str(path)


if __name__ == "__main__":
    main(sys.argv[1:])
