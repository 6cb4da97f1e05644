"""Grammar masks from JSON schemas (bulkgen/engine/features/grammar.py), on the bundled model's tokenizer.

Sampling at temperature 1 from random logits under the mask must give JSON that validates whenever the
mask allowed the end token and it was drawn: the mask alone, not the model, makes the output valid.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from bulkgen.engine.features import schema_compiler
from bulkgen.engine.features.grammar import GrammarRuntime, apply_masks, unpack
from bulkgen.engine.features.guide import GrammarError, Guide, check, compile_guide, grammar
from bulkgen.models.registry import BUNDLED_MODEL
from tests.support.schemas import SLOW_TO_COMPILE, ref_chain

pytestmark = pytest.mark.upstream  # also on the lower bound and the canary (README: tested ranges)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
        "required": ["label"],
        "additionalProperties": False,
    },
    {"$defs": {"p": PERSON}, "type": "array", "items": {"$ref": "#/$defs/p"}, "minItems": 1, "maxItems": 2},
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
            "day": {"type": "string", "format": "date"},
        },
        "required": ["code", "day"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "n": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 2},
                },
                "required": ["v", "kids"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/n",
    },
]


@pytest.fixture(scope="module")
def runtime():
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    return tokenizer, GrammarRuntime(tokenizer, len(tokenizer))


def _sample(runtime, guide: Guide, seed: int, max_tokens: int = 80) -> tuple[list[int], bool]:
    tokenizer, rt = runtime
    gen = torch.Generator().manual_seed(seed)
    matcher, tokens = rt.matcher(guide), []
    for _ in range(max_tokens):
        logits = torch.randn(1, len(tokenizer), generator=gen) * 3
        apply_masks(logits, torch.tensor([0]), rt.masks([matcher]))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if token == tokenizer.eos_token_id:
            return tokens, True
        rt.consume(matcher, token)
        tokens.append(token)
        if matcher.is_stopped():
            return tokens, True
    return tokens, False


def _finished_documents_validate(runtime, schema: dict) -> int:
    """Sample 12 documents under `schema`; every finished one must validate. -> how many finished."""
    tokenizer, finished = runtime[0], 0
    for seed in range(12):
        tokens, done = _sample(runtime, Guide.json_schema(schema), seed)
        if done:
            finished += 1
            jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)
    return finished


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum", "ref-array", "pattern-format", "recursive"])
def test_masked_sampling_from_random_logits_gives_valid_json(runtime, schema):
    assert _finished_documents_validate(runtime, schema) >= 6  # random logits finish most within 80 tokens


def test_json_mode_gives_an_object(runtime):
    tokenizer, _ = runtime
    outputs = [_sample(runtime, Guide.json_object(), seed, 200) for seed in range(6)]
    finished = [json.loads(tokenizer.decode(tokens)) for tokens, done in outputs if done]
    assert finished and all(isinstance(doc, dict) for doc in finished)


def test_one_compile_per_distinct_schema():
    compile_guide.cache_clear()
    a = Guide.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    b = Guide.json_schema(
        json.loads(
            json.dumps(
                {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}, indent=2
            )
        )
    )
    assert a == b
    for _ in range(5):
        check(a)
        check(b)
    assert compile_guide.cache_info().misses == 1
    refused = Guide.json_schema({"$ref": "#"})  # a refusal is kept too: compiled once, refused each time
    for _ in range(3):
        with pytest.raises(GrammarError):
            check(refused)
    assert compile_guide.cache_info().misses == 2
    assert grammar(a) == grammar(b)


@pytest.mark.parametrize(
    "schema,reason",
    [
        ({"type": "object", "properties": {"a": {"type": "strnig"}}}, "strnig"),
        ({"$ref": "#/$defs/missing"}, "does not exist"),
        ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
    ],
)
def test_a_schema_that_cannot_compile_is_a_grammar_error_naming_why(schema, reason):
    with pytest.raises(GrammarError, match=reason) as err:
        check(Guide.json_schema(schema))
    assert "\n" not in str(err.value)  # one line: it becomes a per-line 400 message


@pytest.mark.parametrize(
    "schema",
    [{"$ref": "#"}, {"type": "string", "pattern": "^(a{1000}){1000}$"}],
    ids=["refers-to-itself", "pattern-past-the-lexer-limits"],
)
def test_a_schema_that_admits_no_document_is_refused_at_check(schema):
    """Its matcher fails on the first steps: refused at validation, not "completed" as an empty output."""
    with pytest.raises(GrammarError, match="the schema admits no document") as err:
        check(Guide.json_schema(schema))
    assert "\n" not in str(err.value) and "<non-verbose/>" not in str(err.value)


@pytest.mark.parametrize(
    "schema",
    [ref_chain(1000), {"type": "object", "required": [f"r{i}" for i in range(30_000)]}],
    ids=["1000-refs-deep", "30000-required-names"],
)
def test_a_schema_that_crashes_the_compiler_costs_that_schema_alone(schema):
    """llguidance overflows its stack on these (SIGSEGV): in its helper process, this one survives."""
    assert len(json.dumps(schema)) < schema_compiler.MAX_SCHEMA_BYTES
    with pytest.raises(GrammarError, match=r"the grammar compiler crashed on the schema \(SIGSEGV\)"):
        check(Guide.json_schema(schema))
    check(Guide.json_schema(ref_chain(3)))  # the next schema gets a fresh compiler


def test_a_schema_over_the_size_limit_is_refused_before_compiling():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40_000)}}
    with pytest.raises(GrammarError, match=r"the schema is 1,068,922 bytes of JSON; at most 524,288"):
        check(Guide.json_schema(schema))


def test_a_compile_past_the_time_limit_is_stopped(monkeypatch):
    """7,000 patterned properties (480 KB) take seconds to compile; a limit below that stops the compiler,
    and the next schema compiles in a fresh one."""
    monkeypatch.setattr(schema_compiler, "COMPILE_TIMEOUT_S", 0.5)
    with pytest.raises(GrammarError, match=r"the schema took longer than 0.5 s to compile"):
        check(Guide.json_schema(SLOW_TO_COMPILE))
    check(Guide.json_schema(ref_chain(4)))


def test_compiler_messages_become_one_short_line():
    panic = "panic: index out of bounds\nstack backtrace:\n   0: llguidance::x\n   1: std::rt"
    assert schema_compiler.reason(panic) == "panic: index out of bounds"
    long = "regex parse error: " + "(" * 5000 + "\n" + "^" * 5000 + "\nerror: too many parentheses"
    short = schema_compiler.reason(long)
    assert len(short) <= schema_compiler.MAX_REASON_CHARS and short.endswith("^ error: too many parentheses")


def test_batched_masks_equal_masks_one_by_one(runtime):
    _, rt = runtime
    guides = [Guide.json_schema(s) for s in SCHEMAS]
    matchers = [rt.matcher(g) for g in guides]
    rt.consume(matchers[0], rt.tokenizer.tokenize_str("{")[0])
    together = rt.masks(matchers)
    assert torch.equal(together, torch.cat([rt.masks([m]) for m in matchers]))
    assert not torch.equal(together[0], together[1])  # the first moved on


def test_apply_masks_touches_only_the_constrained_rows():
    logits = torch.zeros(3, 40)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) - (1 << 31)  # tokens 3 and 31 (bit 31 is the int32 sign bit)
    bitmask[0, 1] = 1 << 2  # token 34
    apply_masks(logits, torch.tensor([1]), bitmask)
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3, 31, 34]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    every = torch.zeros(3, 40)  # every row constrained (in place), the masks already unpacked
    apply_masks(every, torch.arange(3), unpack(bitmask.repeat(3, 1), 40))
    assert [torch.isfinite(r).nonzero().flatten().tolist() for r in every] == [[3, 31, 34]] * 3


def _sentencepiece_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2 / Mistral): '▁' for spaces, byte-fallback tokens
    <0x00>..<0xFF> for what its pieces miss, a few multi-character pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += sorted(set('▁{}[]":,abcdefghijklmnopqrstuvwxyz0123456789-')) + [
        '▁"',
        '":',
        "▁{",
        "▁}",
        "ab",
        "abc",
    ]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [("a", "b"), ("ab", "c"), ("▁", '"'), ('"', ":"), ("▁", "{"), ("▁", "}")]
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    core.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    core.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_a_sentencepiece_style_tokenizer_gives_valid_json_too():
    tokenizer = _sentencepiece_tokenizer()
    assert tokenizer.convert_ids_to_tokens(tokenizer("é").input_ids)[-2:] == [
        "<0xC3>",
        "<0xA9>",
    ]  # byte fallback
    runtime = (tokenizer, GrammarRuntime(tokenizer, len(tokenizer)))
    assert _finished_documents_validate(runtime, SCHEMAS[0]) >= 6
