"""Structured outputs in the engine: a schema's grammar masks each constrained row on the logits' device.

The bundled model writes no JSON by itself; under a schema every output that finishes with `stop` must
validate, at temperature 1 and for each of n completions. Greedy constrained decoding must equal
transformers' `generate` with a logits processor built on the same grammar, inside a batch mixed with
unconstrained requests (which must not change), and preemption must not change a constrained output.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.features.grammar import GrammarRuntime, apply_masks
from bulkgen.engine.features.guide import Guide
from bulkgen.engine.sampling.sampling_params import SamplingError
from bulkgen.models.registry import BUNDLED_MODEL
from tests.support.schemas import LATE_FAILURE

LABEL = {
    "type": "object",
    "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
    "required": ["label"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SCHEMAS = {
    "enum": LABEL,
    "object": PERSON,
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": 9},
        "minItems": 2,
        "maxItems": 4,
    },
    "anyOf-const": {
        "anyOf": [
            {"const": "yes"},
            {
                "type": "object",
                "properties": {"why": {"const": "no"}},
                "required": ["why"],
                "additionalProperties": False,
            },
        ]
    },
    "recursive": {
        "$defs": {
            "n": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer", "maximum": 99},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 1},
                },
                "required": ["v", "kids"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/n",
    },
}


@pytest.fixture(scope="module")
def bundled():
    return Engine.from_pretrained(str(BUNDLED_MODEL), max_num_seqs=16)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_outputs_of_the_bundled_model_validate(bundled, name):
    schema = SCHEMAS[name]
    prompts = ["Classify the review: the soup was cold.", "Describe a person.", "Numbers, please:"]
    params = SamplingParams(max_tokens=48, temperature=1.0, n=3, seed=11, guide=Guide.json_schema(schema))
    outs = bundled.generate(prompts, params)
    finished = [c for o in outs for c in o.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 6, [(c.finish_reason, c.text) for o in outs for c in o.outputs]
    for completion in finished:
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_mode_outputs_parse_as_objects(bundled):
    """Free-form keys let the tiny model ramble inside strings; a logit_bias toward closing them (and the
    object) makes documents end, and shows biases and the mask compose."""
    close = {bundled.tokenizer.convert_tokens_to_ids(t): 6.0 for t in ('"', "}")}
    outs = bundled.generate(
        ["Say something."],
        SamplingParams(max_tokens=96, n=6, seed=3, logit_bias=close, guide=Guide.json_object()),
    )
    docs = [json.loads(c.text) for c in outs[0].outputs if c.finish_reason == "stop"]
    assert len(docs) >= 3 and all(isinstance(d, dict) for d in docs), [c.text for c in outs[0].outputs]


def test_without_the_schema_the_bundled_model_writes_no_json(bundled):
    """The guarantee comes from the mask, not from a model that happens to write JSON."""
    outs = bundled.generate(["Describe a person."], SamplingParams(max_tokens=32, n=4, seed=11))
    for completion in outs[0].outputs:
        with pytest.raises(ValueError):
            jsonschema.validate(json.loads(completion.text), PERSON)


class GrammarProcessor(LogitsProcessor):
    """transformers' side of the comparison: the same grammar, consumed token by token in generate."""

    def __init__(self, runtime: GrammarRuntime, guide: Guide, prompt_len: int) -> None:
        self.runtime, self.matcher, self.prompt_len = runtime, runtime.matcher(guide), prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[0, self.prompt_len :].tolist()
        if generated:
            self.runtime.consume(self.matcher, generated[-1])
        apply_masks(scores, torch.tensor([0]), self.runtime.masks([self.matcher]))
        return scores


def test_greedy_constrained_equals_transformers_generate_with_the_grammar(model_dirs, mixed_prompts):
    path = str(model_dirs["llama"])
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = Engine(AutoModelForCausalLM.from_pretrained(path), tokenizer, max_num_batched_tokens=32)
    prompts = mixed_prompts(seed=81, count=4, low=3, high=40)
    guides = [Guide.json_schema(LABEL), Guide.json_schema(PERSON), None, Guide.json_schema(SCHEMAS["array"])]
    params = [SamplingParams(max_tokens=24, temperature=0, guide=g) for g in guides]
    outs = engine.generate(prompts, params)
    runtime = GrammarRuntime(tokenizer, model.config.vocab_size)
    for prompt, guide, out in zip(prompts, guides, outs, strict=True):
        processors = [GrammarProcessor(runtime, guide, len(prompt))] if guide else []
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=24,
                do_sample=False,
                logits_processor=LogitsProcessorList(processors),
            )[0, len(prompt) :].tolist()
        if ref and ref[-1] == tokenizer.eos_token_id and guide:
            ref = ref[:-1]  # the engine ends a complete document without sampling the end token
        assert out.token_ids == ref, (guide, tokenizer.decode(out.token_ids), tokenizer.decode(ref))
    assert (
        outs[0].finish_reason == "stop"
        and json.loads(outs[0].text)["label"] in LABEL["properties"]["label"]["enum"]
    )


def test_preemption_in_the_middle_does_not_change_a_constrained_output(model_dirs, mixed_prompts):
    path = str(model_dirs["llama"])
    prompts = mixed_prompts(seed=82, count=6, low=20, high=40)
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=5, guide=Guide.json_schema(PERSON))

    def run(**kwargs):
        engine = Engine.from_pretrained(path, block_size=4, **kwargs)
        outs = engine.generate(prompts, params)
        return [o.token_ids for o in outs], engine.scheduler.num_preemptions

    roomy, none = run(num_kv_blocks=512)
    tight, preempted = run(num_kv_blocks=40, max_num_seqs=6)
    assert none == 0 and preempted > 0
    assert tight == roomy


def test_logprobs_come_from_the_masked_distribution(model_dirs):
    engine = Engine.from_pretrained(str(model_dirs["llama"]))
    out = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, logprobs=5, guide=Guide.json_schema(LABEL))
    )[0]
    first = out.outputs[0].logprobs[0]
    assert first["token"] == "{" and all(
        t["token"] == "{" or t["logprob"] == float("-inf") for t in first["top_logprobs"]
    )


def test_a_schema_that_cannot_compile_is_refused_when_the_request_is_built():
    with pytest.raises(SamplingError, match="guide cannot be compiled: .*does not exist"):
        SamplingParams(guide=Guide.json_schema({"$ref": "#/$defs/missing"}))


def test_a_seeded_constrained_request_samples_the_same_alone_and_in_a_crowd(model_dirs, mixed_prompts):
    """The mask changes which tokens can be drawn, not the counter-based draws: batch-independent."""
    engine = Engine.from_pretrained(str(model_dirs["llama"]))
    prompts = mixed_prompts(seed=83, count=5, low=3, high=30)
    seeded = SamplingParams(max_tokens=40, temperature=1.0, seed=9, guide=Guide.json_schema(PERSON))
    alone = engine.generate([prompts[0]], seeded)[0].token_ids
    others = [
        SamplingParams(max_tokens=n, temperature=0.8, guide=g)
        for n, g in ((12, None), (30, Guide.json_schema(LABEL)), (7, None), (25, Guide.json_object()))
    ]
    assert engine.generate(prompts, [seeded, *others])[0].token_ids == alone


@pytest.mark.parametrize("overlap", [False, True])
def test_a_grammar_that_fails_as_it_runs_fails_its_request_never_a_stop(model_dirs, mixed_prompts, overlap):
    """The failing request (both of its n completions) comes back with `error` and no text; the requests
    beside it, constrained or not, finish as they would alone, and every KV block is freed."""
    engine = Engine.from_pretrained(str(model_dirs["llama"]), async_scheduling=overlap)
    prompts = mixed_prompts(seed=5, count=3, low=3, high=20)
    params = [
        SamplingParams(max_tokens=150, temperature=1.0, n=2, seed=3, guide=Guide.json_schema(LATE_FAILURE)),
        SamplingParams(max_tokens=60, temperature=0, guide=Guide.json_schema(LABEL)),
        SamplingParams(max_tokens=9, temperature=0),
    ]
    failed, label, plain = engine.generate(prompts, params)
    assert failed.outputs == [] and "the schema's grammar failed during decoding" in failed.error
    assert "too many expressions" in failed.error and "\n" not in failed.error
    assert label.error is None and label.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(label.text), LABEL)
    assert plain.token_ids == engine.generate([prompts[2]], params[2])[0].token_ids
    assert engine.requests == {} and engine.block_manager.num_free_blocks == engine.runner.num_blocks
