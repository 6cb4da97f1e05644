"""Cost of structured outputs: the same requests with and without a JSON schema, in one run.

Workload: 64 concurrent chat requests to the bundled model on CPU (max_num_seqs 64), 48 output tokens
each, at temperature 0.8 with a seed per request, from a cold prefix cache; free, then under a schema whose long free-text
field keeps constrained outputs about as long as free ones; twice each, interleaved, the best kept.
Reported: output tokens/s both ways and their ratio (goal >= 0.8), the mean time to fill one step's
masks (on a thread, overlapped with the forward) and the time a step still waited for them after its
forward. With a GPU, `--gpu` runs the same on a random model of the Llama-3.2-1B shape (bf16).
`--mixed`: every request its own schema (its own property names, enum, types and nesting: a grammar compiled
and a matcher built per distinct schema, as a file of mixed extraction tasks has); goal >= 0.5.

    OMP_NUM_THREADS=2 python bench/bench_structured.py [--requests 64] [--mixed] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

GOAL = 0.8
MIXED_GOAL = 0.5
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "summary": {"type": "string", "maxLength": 400},
    },
    "required": ["label", "summary"],
    "additionalProperties": False,
}
TOPICS = [
    "the soup",
    "a train ride",
    "the new phone",
    "a museum",
    "the weather",
    "a library card",
    "the rent",
    "a concert",
]


def mixed_schema(i: int) -> dict:
    """Request i's own schema: names, labels, types and shape all vary with i, so no two compile alike."""
    labels = [f"class_{i}_{k}" for k in range(2 + i % 5)]
    props = {
        f"label_{i}": {"enum": labels},
        f"summary_{i}": {"type": "string", "maxLength": 200 + 10 * (i % 7)},
    }
    if i % 2:
        props[f"score_{i}"] = {"type": "integer", "minimum": 0, "maximum": 10 + i}
    if i % 3 == 0:
        props[f"tags_{i}"] = {"type": "array", "items": {"type": "string"}, "maxItems": 1 + i % 4}
    if i % 4 == 1:
        props[f"meta_{i}"] = {
            "type": "object",
            "properties": {"source": {"type": "string"}, "ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        }
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


class TimedRuntime:
    """Wraps the engine's GrammarRuntime.masks to time each step's fill."""

    def __init__(self, runtime) -> None:
        self.runtime, self.fill_s = runtime, []
        self._masks = runtime.masks
        runtime.masks = self.masks

    def masks(self, matchers, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self._masks(matchers, *args, **kwargs)
        finally:
            self.fill_s.append(time.perf_counter() - started)


def build(args):
    from bulkgen.engine import Engine

    if not args.gpu:
        from bulkgen.models.registry import BUNDLED_MODEL

        return Engine.from_pretrained(str(BUNDLED_MODEL), device="cpu", max_num_seqs=args.requests)
    import gpu as anchor

    model, tokenizer = anchor.build_model(anchor.ANCHOR, "cuda", 0)
    return Engine(model, tokenizer, max_num_seqs=args.requests)


def prompts(engine, count: int) -> list[list[int]]:
    tok = engine.tokenizer
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": f"Review {TOPICS[i % len(TOPICS)]} in one paragraph ({i})."}]
        text = messages[0]["content"]
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(list(tok(text, add_special_tokens=False).input_ids))
    return out


def timed_run(engine, requests, guides: list, max_tokens: int) -> dict:
    from bulkgen.engine import SamplingParams

    params = [
        SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, guide=guides[i])
        for i in range(len(requests))
    ]
    engine.reset()  # a cold prefix cache for each run
    waited = _wait_clock(engine)
    started = time.perf_counter()
    outs = engine.generate(requests, params)
    wall = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "ran_to_max_tokens": sum(c.finish_reason == "length" for o in outs for c in o.outputs),
        "mask_wait_s": round(sum(waited), 4),
        "outputs": outs,
    }


def _wait_clock(engine) -> list[float]:
    """Time each step spends in Future.result() after its forward: the masks' cost not hidden."""
    waits: list[float] = []
    start = engine._start_masks

    def start_masks(items):
        pending = start(items)
        if pending is None:
            return None
        guided, future = pending
        result = future.result

        def timed_result(*a, **k):
            t = time.perf_counter()
            try:
                return result(*a, **k)
            finally:
                waits.append(time.perf_counter() - t)

        future.result = timed_result
        return guided, future

    engine._start_masks = start_masks
    return waits


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="random Llama-3.2-1B shape on CUDA")
    parser.add_argument("--mixed", action="store_true", help="every request its own schema (goal >= 0.5)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from bulkgen.engine.features.guide import Guide

    engine = build(args)
    requests = prompts(engine, args.requests)
    timer = TimedRuntime(engine.grammars)
    engine.generate(requests[:4], None)  # warm-up
    n = len(requests)
    schemas = [mixed_schema(i) if args.mixed else SCHEMA for i in range(n)]
    runs = {"free": [], "constrained": []}
    for repeat in range(args.repeats):  # interleaved, so load from other processes hits both alike
        runs["free"].append(timed_run(engine, requests, [None] * n, args.max_tokens))
        if args.mixed:  # new schemas each repeat: no grammar compiled in an earlier run is reused
            schemas = [mixed_schema(i + repeat * n) for i in range(n)]
        guides = [Guide.json_schema(schema) for schema in schemas]
        runs["constrained"].append(timed_run(engine, requests, guides, args.max_tokens))
        runs["constrained"][-1]["schemas"] = schemas
    free, constrained = (max(runs[k], key=lambda r: r["tokens_per_s"]) for k in ("free", "constrained"))
    valid = _valid(constrained.pop("outputs"), constrained.pop("schemas"))
    free.pop("outputs")
    report = {
        "device": "cuda" if args.gpu else "cpu",
        "requests": args.requests,
        "free": free,
        "constrained": constrained,
        "valid_finished_outputs": valid,
        "mask_fill_ms_per_step": round(1000 * sum(timer.fill_s) / max(1, len(timer.fill_s)), 3),
        "schemas": "one per request" if args.mixed else "one",
        "ratio": round(constrained["tokens_per_s"] / free["tokens_per_s"], 3),
        "goal": MIXED_GOAL if args.mixed else GOAL,
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(
            f"{report['device']}, {args.requests} concurrent requests, {args.max_tokens} tokens max, "
            f"{report['schemas']} schema"
        )
        for name in ("free", "constrained"):
            r = report[name]
            print(
                f"  {name:12} {r['wall_s']:7.2f} s  {r['tokens_per_s']:8.1f} tok/s  ({r['output_tokens']} tokens, "
                f"{r['ran_to_max_tokens']} ran to max_tokens)"
            )
        print(
            f"  constrained / free: {report['ratio']:.2f}x (goal >= {report['goal']}); masks {report['mask_fill_ms_per_step']} "
            f"ms per step, {constrained['mask_wait_s']} s waited after forwards; valid: {valid}"
        )
    return report


def _valid(outs, schemas: list[dict]) -> str:
    import jsonschema

    finished = [(c, schema) for o, schema in zip(outs, schemas, strict=True) for c in o.outputs]
    finished = [(c, schema) for c, schema in finished if c.finish_reason == "stop"]
    ok = 0
    for c, schema in finished:
        try:
            jsonschema.validate(json.loads(c.text), schema)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return f"{ok}/{len(finished)}"


if __name__ == "__main__":
    main(sys.argv[1:])
