"""xgrammar against llguidance on the JSON-schema features bulk extraction jobs use.

For each schema of the corpus and each library: does it compile, how long that takes, and is the
schema enforced: random walks that pick uniformly among the tokens the matcher allows (ending as soon
as the end token is allowed, with probability 1/2) must give JSON that validates with `jsonschema`.
Also the mean time to compute one token mask. Tokenizer: the bundled model's (byte-level BPE, 4,096).

    pip install xgrammar && python bench/grammar_libs.py [--walks 20] [--json]

(xgrammar is not a bulkgen dependency: without it only llguidance is measured.)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CORPUS = {
    "enum": {
        "type": "object",
        "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["label"],
        "additionalProperties": False,
    },
    "const": {
        "type": "object",
        "properties": {"kind": {"const": "invoice"}, "n": {"type": "integer"}},
        "required": ["kind", "n"],
        "additionalProperties": False,
    },
    "anyOf": {
        "anyOf": [
            {"type": "integer"},
            {
                "type": "object",
                "properties": {"x": {"type": "boolean"}},
                "required": ["x"],
                "additionalProperties": False,
            },
        ]
    },
    "min/max": PERSON,
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "format date": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}},
        "required": ["day"],
        "additionalProperties": False,
    },
    "format email": {
        "type": "object",
        "properties": {"to": {"type": "string", "format": "email"}},
        "required": ["to"],
        "additionalProperties": False,
    },
    "$defs + $ref": {
        "$defs": {"person": PERSON},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/person"}},
        "required": ["a"],
        "additionalProperties": False,
    },
    "recursive $ref": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v", "kids"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
    "json_object": {"type": "object"},
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, len(tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab)
        self.compiler = xgr.GrammarCompiler(info)

    def matcher(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)
        return self.xgr.GrammarMatcher(compiled)

    def allowed(self, matcher) -> torch.Tensor:
        mask = self.xgr.allocate_token_bitmask(1, self.vocab)
        matcher.fill_next_token_bitmask(mask)
        return _unpack(mask[0], self.vocab)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt, self.vocab = llguidance, llguidance.torch, len(tokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab)

    def matcher(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        is_error, messages = self.ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError("; ".join(messages))
        return self.ll.LLMatcher(self.tokenizer, grammar)

    def allowed(self, matcher) -> torch.Tensor:
        mask = self.llt.allocate_token_bitmask(1, self.vocab)
        self.llt.fill_next_token_bitmask(matcher, mask, 0)
        return _unpack(mask[0], self.vocab)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


def _unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (words[:, None].to(torch.int64) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab].bool()


def walk(lib, matcher, rng: random.Random, eos: int, max_tokens: int) -> tuple[list[int] | None, list[float]]:
    tokens, times = [], []
    for _ in range(max_tokens):
        started = time.perf_counter()
        allowed = lib.allowed(matcher).nonzero().flatten().tolist()
        times.append(time.perf_counter() - started)
        if eos in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return tokens, times
        token = rng.choice([t for t in allowed if t != eos])
        assert lib.accept(matcher, token)
        tokens.append(token)
        if lib.done(matcher):
            return tokens, times
    return None, times


def evaluate(lib, tokenizer, walks: int) -> dict:
    import jsonschema

    out = {}
    for name, schema in CORPUS.items():
        started = time.perf_counter()
        try:
            lib.matcher(schema)
        except Exception as exc:  # noqa: BLE001 - a schema the library refuses
            out[name] = {"compiles": False, "error": str(exc)[:120]}
            continue
        row = {"compiles": True, "compile_ms": round((time.perf_counter() - started) * 1000, 1)}
        valid = finished = 0
        times: list[float] = []
        rng = random.Random(0)
        for _ in range(walks):
            tokens, took = walk(lib, lib.matcher(schema), rng, tokenizer.eos_token_id, 120)
            times += took
            if tokens is None:
                continue
            finished += 1
            try:
                jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                row.setdefault("invalid_example", f"{tokenizer.decode(tokens)[:60]!r}: {str(exc)[:60]}")
        row.update(finished=finished, valid=valid, mask_us=round(statistics.mean(times) * 1e6, 1))
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--walks", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from bulkgen.models.registry import BUNDLED_MODEL

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    libs = [LLGuidance(tokenizer)]
    try:
        libs.insert(0, XGrammar(tokenizer))
    except ImportError:
        print("xgrammar is not installed: measuring llguidance only", file=sys.stderr)
    report = {lib.name: evaluate(lib, tokenizer, args.walks) for lib in libs}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{'schema':18} " + "  ".join(f"{n:>34}" for n in report))
        for name in CORPUS:
            cells = []
            for lib in report.values():
                r = lib[name]
                cells.append(
                    f"{'no: ' + r['error'][:30]:>34}"
                    if not r["compiles"]
                    else f"{r['valid']:>3}/{r['finished']:<3} valid, {r['compile_ms']:>6} ms, {r['mask_us']:>6} us"
                )
            print(f"{name:18} " + "  ".join(cells))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
