"""Structured outputs with images in the engine (lab/tiny_vision.py's LLaVA): a schema's grammar masks the
rows of a prompt whose image embeddings were spliced in. Greedy constrained decoding over an image equals
transformers' `generate` on the processor's inputs with a logits processor on the same grammar, and sampled
completions (n, seeds) beside text-only ones all parse against the schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, LogitsProcessorList

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.features.grammar import GrammarRuntime
from bulkgen.engine.features.guide import Guide
from bulkgen.engine.features.multimodal import process
from tests.engine.test_engine_structured import GrammarProcessor
from tests.support.schemas import ANIMAL

MAX_TOKENS = 40
SEEDS = (1, 4, 7)  # noise images the tiny model answers differently (dog, bird, bird)


def noise_image(seed: int) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(30, 40, 3, generator=gen) * 255).to(torch.uint8).numpy())


@pytest.fixture(scope="module")
def engine(vlm_path):
    return Engine.from_pretrained(str(vlm_path), max_num_batched_tokens=32)  # image runs split over chunks


def _text(processor, images: int) -> str:
    content = [{"type": "image"}] * images + [{"type": "text", "text": "Which animal, and how many?"}]
    return processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def _run(engine, requests: list[tuple[int, SamplingParams]]) -> dict:
    """request id -> output, for (image seed or -1 for none, params) requests run in one batch."""
    for i, (seed, params) in enumerate(requests):
        images = [noise_image(seed)] if seed >= 0 else []
        ids, inputs = process(engine.processor, _text(engine.processor, len(images)), images)
        engine.add_request(str(i), ids, params, images=inputs)
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    return outputs


def test_greedy_constrained_over_an_image_equals_transformers_generate_with_the_grammar(engine, vlm_path):
    guide = Guide.json_schema(ANIMAL)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, guide=guide)
    outputs = _run(engine, [(seed, params) for seed in SEEDS])
    reference = AutoModelForImageTextToText.from_pretrained(vlm_path, local_files_only=True).eval()
    processor, tokenizer = engine.processor, engine.processor.tokenizer
    runtime = GrammarRuntime(tokenizer, reference.config.text_config.vocab_size)
    answers = set()
    for i, seed in enumerate(SEEDS):
        encoded = processor(
            text=_text(processor, 1),
            images=[noise_image(seed)],
            return_tensors="pt",
            add_special_tokens=False,
        )
        prompt_len = encoded["input_ids"].shape[1]
        with torch.no_grad():
            ref = reference.generate(
                **encoded,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                logits_processor=LogitsProcessorList([GrammarProcessor(runtime, guide, prompt_len)]),
            )[0, prompt_len:].tolist()
        if ref and ref[-1] == tokenizer.eos_token_id:
            ref = ref[:-1]  # the engine ends a complete document without sampling the end token
        out = outputs[str(i)].outputs[0]
        assert out.token_ids == ref, (tokenizer.decode(out.token_ids), tokenizer.decode(ref))
        assert out.finish_reason == "stop"
        answers.add(out.text)
        jsonschema.validate(json.loads(out.text), ANIMAL)
    assert len(answers) > 1  # the images, not the schema alone, decide the answer


def test_sampled_completions_with_images_parse_against_the_schema(engine):
    guide = Guide.json_schema(ANIMAL)
    requests = [
        (seed, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, n=2, seed=seed, guide=guide))
        for seed in (4, 5, 6, -1)
    ]
    requests.append((7, SamplingParams(max_tokens=6, temperature=0)))  # unconstrained beside them
    outputs = _run(engine, requests)
    completions = [c for i in range(4) for c in outputs[str(i)].outputs]
    assert len(completions) == 8 and all(c.finish_reason == "stop" for c in completions)
    for completion in completions:
        jsonschema.validate(json.loads(completion.text), ANIMAL)
    assert len(outputs["4"].outputs[0].token_ids) == 6
