"""Image captioning throughput: bulkgen's engine against transformers' `generate` in static batches, same run.

Workload: N lines, each one image (seeded noise, sizes varied) and a short question of varied length, as
a captioning batch is; outputs of uniform 4-32 tokens with EOS ignored, so both methods generate exactly
the same number of tokens. The model is a random-weight LLaVA (bulkgen.lab.tiny_vision, a CLIP encoder
and a Llama; `--hidden` sets the language model's width) with its locally saved processor. Greedy
decoding everywhere; preprocessing (the processor) is done before either clock starts, as a worker does
it off the engine thread.

- HF static: `model.generate` on left-padded batches of `--batch` lines in the given order, each batch
  with its pixel values, running for its longest request.
- bulkgen: `Engine.add_request(..., images=...)` for every line, then `step()` until done.

Each side is warmed up first (its first forward passes are slower than the rest), then the two are timed
in turn `--repeat` times and each keeps its best: on a shared machine another process taking the cores
slows one run, not a method.

    python bench/bench_vision.py [--quick] [--lines N] [--hidden H] [--batch B] [--repeat R] [--device cuda]

Prints the configuration (model, dtype, device, threads, engine limits, the load average), output tokens/s
of each and bulkgen's ratio to HF static.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

QUESTIONS = ["Describe this image.", "What is shown here?", "Caption it in one line.", "What colours appear?"]


def workload(lines: int, seed: int = 0) -> list[tuple[Image.Image, str, int]]:
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        w, h = rng.randint(24, 96), rng.randint(24, 96)
        pixels = (torch.rand(h, w, 3, generator=gen) * 255).to(torch.uint8).numpy()
        question = QUESTIONS[i % len(QUESTIONS)] + " Be brief." * rng.randint(0, 3)
        out.append((Image.fromarray(pixels), question, rng.randint(4, 32)))
    return out


def render(processor, question: str) -> str:
    content = [{"type": "image"}, {"type": "text", "text": question}]
    return processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def hf_inputs(model, processor, work, batch: int) -> list[tuple[dict, int]]:
    """The static batches as transformers takes them (left-padded, with pixels), and each one's steps."""
    processor.tokenizer.padding_side = "left"
    inputs = []
    for first in range(0, len(work), batch):
        group = work[first : first + batch]
        encoded = processor(
            text=[render(processor, q) for _, q, _ in group],
            images=[img for img, _, _ in group],
            padding=True,
            return_tensors="pt",
            add_special_tokens=False,
        )
        inputs.append(({k: v.to(model.device) for k, v in encoded.items()}, max(n for *_, n in group)))
    return inputs


@torch.no_grad()
def hf_static(model, processor, inputs: list[tuple[dict, int]]) -> float:
    """Seconds for every static batch, each run for its longest request."""
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for encoded, steps in inputs:
        out = model.generate(
            **encoded,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=processor.tokenizer.pad_token_id,
            eos_token_id=None,
        )
        if out.shape[1] - encoded["input_ids"].shape[1] != steps:
            raise RuntimeError("HF static generated a different number of tokens than asked")
    sync()
    return time.perf_counter() - started


def bulkgen(engine, prepared: list, work, run: str) -> tuple[float, int]:
    """(seconds, output tokens) for every line through the engine; `run` names this run's requests."""
    from bulkgen.engine import SamplingParams

    started = time.perf_counter()
    for i, ((ids, images), (*_, n)) in enumerate(zip(prepared, work, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        engine.add_request(f"{run}-{i}", ids, params, images=images)
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.outputs[0].token_ids) for o in engine.step())
    return time.perf_counter() - started, generated


def measure(model, engine, work, args) -> dict:
    """Both methods warmed up, then timed in turn `args.repeat` times: the best seconds of each."""
    from bulkgen.engine.features.multimodal import process

    processor = engine.processor
    inputs = hf_inputs(model, processor, work, args.batch)
    prepared = [process(processor, render(processor, q), [img]) for img, q, _ in work]
    hf_static(model, processor, [(inputs[0][0], 2)])
    bulkgen(engine, prepared[:2], [(None, None, 2)] * 2, "warm")
    useful = sum(n for *_, n in work)
    hf_s, bg_s = float("inf"), float("inf")
    for r in range(args.repeat):
        hf_s = min(hf_s, hf_static(model, processor, inputs))
        seconds, generated = bulkgen(engine, prepared, work, f"r{r}")
        if generated != useful:
            raise RuntimeError(f"bulkgen generated {generated} tokens, HF static {useful}")
        bg_s = min(bg_s, seconds)
    return {
        "output_tokens": useful,
        "hf_static_tok_s": useful / hf_s,
        "bulkgen_tok_s": useful / bg_s,
        "ratio_vs_hf_static": hf_s / bg_s,
    }


def configuration(args, engine, dtype: torch.dtype) -> dict:
    import transformers

    return {
        "model": f"tiny LLaVA (CLIP 2 layers x 32, 28-pixel images; Llama 2 layers x {args.hidden}), random weights",
        "lines": args.lines,
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "hf_batch": args.batch,
        "max_num_seqs": engine.config.max_num_seqs,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
        "repeat": args.repeat,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average": round(os.getloadavg()[0], 1),
        "cpu_count": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 lines on the 64-wide model: a smoke run")
    parser.add_argument("--lines", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of each method, alternating")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.lines, args.hidden, args.repeat = 12, 64, 1
    from transformers import AutoModelForImageTextToText

    from bulkgen.engine import Engine
    from bulkgen.lab.tiny_vision import build_tiny_vlm

    work = workload(args.lines)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_vlm(Path(tmp) / "llava", "llava", seed=0, hidden_size=args.hidden)
        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, local_files_only=True)
        model = model.to(args.device).eval()
        engine = Engine.from_pretrained(
            str(path), device=args.device, dtype=dtype, max_num_seqs=args.batch * 2
        )
        config = configuration(args, engine, dtype)
        result = {**config, **measure(model, engine, work, args)}
    if args.json:
        print(json.dumps(result))
        return
    print("configuration: " + ", ".join(f"{k} {v}" for k, v in config.items()))
    print(f"{args.lines} captioning lines, {result['output_tokens']} output tokens, {args.device}")
    print(f"HF static (batches of {args.batch}) {result['hf_static_tok_s']:9.1f} tok/s")
    print(f"bulkgen engine           {result['bulkgen_tok_s']:9.1f} tok/s")
    print(
        f"ratio bulkgen / HF static {result['ratio_vs_hf_static']:.2f}x (best of {args.repeat} each, same run)"
    )


if __name__ == "__main__":
    main()
