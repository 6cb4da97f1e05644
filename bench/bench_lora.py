"""What do mixed LoRA adapters cost a packed step? The same requests on the base model alone, then spread
over 8 adapters (rank 16 on q/k/v/o/gate/up/down) in one batch, in one run. Goal on CPU: the mixed
throughput at least 0.7x the base's.

A random Llama (default hidden 512, 4 layers: big enough that the base GEMMs, not Python, dominate a
step, as they do in any real model) and 8 random PEFT adapters are written to a temporary folder; every
request is greedy with a fixed output length, so both runs compute exactly the same tokens. Each run is
repeated (`--repeats`, alternating base and mixed) and the fastest of each is kept, in wall time and in
this process's CPU time: on a shared machine other processes stretch wall time at random, while CPU time
counts only the work this process did (`--threads`, default 1, keeps torch on one core so both agree
when the machine is quiet).

    python bench/bench_lora.py [--requests 64] [--prompt-tokens 64] [--max-tokens 32] [--device cpu]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

ADAPTERS = 8
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(root: Path, hidden: int, layers: int) -> tuple[Path, list[Path]]:
    """A random model and ADAPTERS random rank-RANK adapters of it (B non-zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bulkgen.lab.tiny import build_tiny_model

    model_path = build_tiny_model(
        root / "model",
        seed=0,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
    )
    adapters = []
    for i in range(ADAPTERS):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(str(model_path))
        config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(str(root / f"adapter{i}"))
        adapters.append(root / f"adapter{i}")
    return model_path, adapters


def timed_run(
    engine, prompts: list[list[int]], loras: list[str | None], max_tokens: int
) -> tuple[float, float, int]:
    """Wall and CPU seconds to finish every request, and the tokens generated."""
    from bulkgen.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(str(i), prompt, params, lora=lora)
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.outputs[0].token_ids) for o in engine.step())
    return time.perf_counter() - start, time.process_time() - cpu, generated


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)

    from bulkgen.engine import Engine

    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        model_path, adapters = build(Path(tmp), args.hidden, args.layers)
        engine = Engine.from_pretrained(
            str(model_path), device=args.device, max_loras=ADAPTERS, max_lora_rank=RANK
        )
        for i, folder in enumerate(adapters):
            engine.add_lora(f"a{i}", folder)
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(0, 256, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.requests)
        ]
        runs = {"base": [None] * args.requests, "mixed": [f"a{i % ADAPTERS}" for i in range(args.requests)]}
        timed_run(engine, prompts[:8], runs["mixed"][:8], 4)  # warm-up: every adapter loaded into its slot
        wall = {name: float("inf") for name in runs}
        cpu = dict(wall)
        tokens = {}
        for _ in range(args.repeats):
            for name, loras in runs.items():
                seconds, cpu_seconds, tokens[name] = timed_run(engine, prompts, loras, args.max_tokens)
                wall[name], cpu[name] = min(wall[name], seconds), min(cpu[name], cpu_seconds)
    if tokens["base"] != tokens["mixed"]:
        raise SystemExit(f"runs generated different token counts: {tokens}")
    print(
        f"model hidden {args.hidden}, {args.layers} layers, {args.device}; {args.requests} requests of "
        f"{args.prompt_tokens} prompt + {args.max_tokens} output tokens; {ADAPTERS} adapters of rank {RANK} "
        f"on {'/'.join(t.removesuffix('_proj') for t in TARGETS)}"
    )
    for name in runs:
        print(
            f"{name:6s} wall {wall[name]:.3f} s ({tokens[name] / wall[name]:,.0f} tokens/s), "
            f"cpu {cpu[name]:.3f} s ({tokens[name] / cpu[name]:,.0f} tokens/cpu-s)"
        )
    print(
        f"mixed / base throughput: {wall['base'] / wall['mixed']:.2f}x wall, "
        f"{cpu['base'] / cpu['mixed']:.2f}x cpu (goal >= 0.7x)"
    )


if __name__ == "__main__":
    main()
