"""Embedding throughput: bulkgen's packed prefill against sentence-transformers' own `encode`, same run.

Workload: texts of mixed lengths (uniform 8-512 byte tokens of the tiny byte-level tokenizer), embedded by a
random-weight Llama built from a config with a fixed seed and saved as a sentence-transformers folder
(last-token pooling, normalised). sentence-transformers sorts its inputs by length and pads each batch of
`--st-batch` to its longest; bulkgen packs every input into varlen steps of `max_num_batched_tokens` with no
padding. Both run fp32 on CPU with the same thread count; each is warmed up once (not timed). The vectors are
checked to agree (cosine); the two are timed alternately `--repeat` times and the best of each counts.

Goal: bulkgen >= 2x sentence-transformers' input tokens/s on CPU.

    python bench/bench_embed.py [--quick] [--json]
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

GOAL = 2.0
MODEL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 768,
}


def texts_of(count: int, lengths: tuple[int, int], seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    return ["".join(rng.choice(letters) for _ in range(rng.randint(*lengths))) for _ in range(count)]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 texts instead of 1,024")
    parser.add_argument("--texts", type=int, help="number of texts (overrides --quick)")
    parser.add_argument(
        "--repeat", type=int, default=2, help="timed runs of each, alternated; the best counts"
    )
    parser.add_argument(
        "--st-batch", type=int, default=32, help="sentence-transformers' batch size (its default)"
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="bulkgen's step budget (default: the device's)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, help="bulkgen's sequences per step (default: the device's)"
    )
    parser.add_argument("--threads", type=int, help="torch threads for both (1: immune to a busy machine)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    from bulkgen.engine import Engine
    from bulkgen.lab.tiny import add_sentence_transformers_config, build_tiny_model

    if args.threads:
        torch.set_num_threads(args.threads)
    texts = texts_of(args.texts or (256 if args.quick else 1024), (8, 512))
    with tempfile.TemporaryDirectory() as tmp:
        path = add_sentence_transformers_config(
            build_tiny_model(Path(tmp) / "m", seed=0, **MODEL), "lasttoken"
        )
        st = SentenceTransformer(str(path), device="cpu")
        engine = Engine.from_pretrained(
            str(path),
            enable_prefix_caching=False,  # repeats must not hit a cache
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
        )
        st.encode(texts[:8], batch_size=args.st_batch)
        engine.embed(texts[:8])
        st_times, bg_times = [], []
        for _ in range(args.repeat):  # alternated, best of each: other load on the machine hits both alike
            st_s, st_vecs = timed(lambda: st.encode(texts, batch_size=args.st_batch))
            bg_s, bg_vecs = timed(lambda: engine.embed(texts))
            st_times.append(st_s)
            bg_times.append(bg_s)
        st_s, bg_s = min(st_times), min(bg_times)
    tokens = sum(len(t) for t in texts)  # one byte token per character (ASCII)
    cosine = torch.nn.functional.cosine_similarity(torch.tensor(bg_vecs), torch.tensor(st_vecs)).min().item()
    result = {
        "texts": len(texts),
        "input_tokens": tokens,
        "threads": torch.get_num_threads(),
        "bulkgen_step": [engine.config.max_num_seqs, engine.config.max_num_batched_tokens],
        "sentence_transformers_s": round(st_s, 3),
        "bulkgen_s": round(bg_s, 3),
        "sentence_transformers_tokens_per_s": round(tokens / st_s),
        "bulkgen_tokens_per_s": round(tokens / bg_s),
        "ratio": round(st_s / bg_s, 2),
        "goal": GOAL,
        "min_cosine": round(cosine, 6),
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:36} {value}")
    return 0 if cosine >= 0.9999 else 1


if __name__ == "__main__":
    sys.exit(main())
