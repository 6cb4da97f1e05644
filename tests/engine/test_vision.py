"""Vision-language models in the engine, token for token against transformers' greedy `generate`.

Each tiny model (random weights, fixed seed, fp32 CPU: bulkgen.lab.tiny_vision) runs one batch mixing a
text-only prompt, one image, two images and the same image twice, packed into one engine whose small step
budget splits image runs across prefill chunks; then with a KV cache too small for the batch (preemption
recomputes). The reference is `generate` on the processor's inputs for each prompt alone. Images are
made here with PIL from seeded noise.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.features.multimodal import VisionTower, process, text_model
from bulkgen.lab.tiny import build_tiny_model
from bulkgen.lab.tiny_vision import VISION_FAMILIES, build_tiny_vlm, load_processor

# the canary runs it on the newest releases; not the lower bound (docs/limits.md)
pytestmark = pytest.mark.canary

MAX_TOKENS = 8


def noise_image(seed: int, size: tuple[int, int] = (40, 30)) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=gen) * 255).to(torch.uint8)
    return Image.fromarray(pixels.numpy())


@pytest.fixture(scope="module")
def family_dirs(tiny_model):
    def path(family: str):
        return tiny_model(family, seed=5, builder=build_tiny_vlm)

    return path


class Fixture:
    """An engine-ready model folder, its processor and transformers' own model for the reference."""

    def __init__(self, path):
        self.path = path
        self.reference = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval()
        self.processor = load_processor(path)

    def prompt(self, images: list, question: str) -> tuple[list[int], object, dict]:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        text = self.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        ids, inputs = process(self.processor, text, images)
        encoded = self.processor(
            text=text, images=images or None, return_tensors="pt", add_special_tokens=False
        )
        return ids, inputs, encoded

    def expected(self, encoded: dict) -> list[int]:
        with torch.no_grad():
            out = self.reference.generate(**encoded, max_new_tokens=MAX_TOKENS, do_sample=False)
        return out[0, encoded["input_ids"].shape[1] :].tolist()

    def engine(self, **kwargs) -> Engine:
        """An engine over the model as loaded from its folder (Qwen2.5-VL's processor cannot be loaded
        back here, so the engine is assembled as Engine.from_pretrained assembles it)."""
        vlm = AutoModelForImageTextToText.from_pretrained(self.path, local_files_only=True)
        return Engine(
            text_model(vlm), self.processor.tokenizer, vision=VisionTower(vlm, self.processor), **kwargs
        )


@pytest.fixture(scope="module")
def fixtures(family_dirs):
    """family -> its Fixture, built once per module."""
    built = {}

    def get(family: str) -> Fixture:
        if family not in built:
            built[family] = Fixture(family_dirs(family))
        return built[family]

    return get


@pytest.fixture(scope="module", params=VISION_FAMILIES)
def vlm(request, fixtures):
    return fixtures(request.param)


def mixed_batch(fx: Fixture) -> list[tuple[list[int], object, list[int]]]:
    """(ids, images, transformers' tokens): text only, one image, two images, the same image twice
    (the references computed once per model)."""
    if getattr(fx, "batch", None) is None:
        fx.batch = _mixed_batch(fx)
    return fx.batch


def _mixed_batch(fx: Fixture) -> list[tuple[list[int], object, list[int]]]:
    cases = [
        ([], "Say something."),
        ([noise_image(1)], "What is in this picture?"),
        ([noise_image(2), noise_image(3, (24, 50))], "Compare the two."),
        ([noise_image(4), noise_image(4)], "Are these equal?"),
    ]
    out = []
    for images, question in cases:
        ids, inputs, encoded = fx.prompt(images, question)
        assert len(ids) == encoded["input_ids"].shape[1]
        out.append((ids, inputs, fx.expected(encoded)))
    return out


def run(engine: Engine, batch) -> list[list[int]]:
    """Each prompt's greedy tokens, all of `batch` in one engine."""
    return [out.outputs[0].token_ids for out in run_outputs(engine, batch)]


def run_outputs(engine: Engine, batch) -> list:
    for i, (ids, inputs, _) in enumerate(batch):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), images=inputs)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    return [done[str(i)] for i in range(len(batch))]


def test_greedy_tokens_equal_generate_with_image_runs_split_across_chunks(vlm):
    batch = mixed_batch(vlm)
    engine = vlm.engine(max_num_seqs=4, block_size=4, max_num_batched_tokens=5)
    split = []  # chunks that start inside an image's placeholder run
    kept = []  # whether a request past its last image token still held its embeddings
    run_step = engine.runner.run

    def watch(items, pending=None):
        for seq, _ in items:
            images = seq.request.images
            if (
                images is not None
                and 0 < seq.num_computed_tokens
                and seq.num_computed_tokens - 1 in images.rows
            ):
                split.append(seq.num_computed_tokens in images.rows)
            if images is not None and all(s.num_computed_tokens > images.last_row for s in seq.request.seqs):
                kept.append(images.embeds is not None)
        return run_step(items, pending)

    engine.runner.run = watch
    assert run(engine, batch) == [expected for *_, expected in batch]
    if engine.vision.bidirectional:  # Gemma 3: a chunk takes an image block whole (image_blocks.py)
        assert split and not any(split), "a prefill chunk resumed inside a bidirectional image block"
    else:
        assert any(split), "no prefill chunk resumed inside an image's run"
    assert kept and not any(kept), "embeddings kept after every sequence passed its last image token"


def test_greedy_tokens_equal_generate_under_preemption(vlm):
    batch = mixed_batch(vlm)
    bs = 2  # small blocks: a decoding sequence outgrows its blocks every other token
    # blocks one sequence holds over all its KV groups (Gemma 3 has a sliding and a full one)
    peak = vlm.engine(block_size=bs, max_num_batched_tokens=64, num_kv_blocks=1).runner.peak_blocks
    lengths = sorted(len(ids) for ids, *_ in batch)
    # the two shortest prompts are admitted together and then outgrow it; the longest request fits alone
    cache = max(peak(lengths[0]) + peak(lengths[1]) + 1, peak(lengths[-1] + MAX_TOKENS))
    assert peak(lengths[0] + MAX_TOKENS) + peak(lengths[1] + MAX_TOKENS) > cache
    engine = vlm.engine(
        max_num_seqs=4,
        block_size=bs,
        max_num_batched_tokens=64,
        num_kv_blocks=cache,
        admission="shortest_first",
        cuda_graphs=True,
    )
    assert run(engine, batch) == [expected for *_, expected in batch]
    assert engine.stats()["preemptions"] > 0
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_n_completions_logprobs_and_seeds_work_with_an_image(fixtures):
    """n=2 greedy completions of one image line each give transformers' tokens with their logprobs; a
    seeded sampled line gives the same tokens again in another engine (Qwen3-VL: the family with the
    most per-request image state)."""
    vlm = fixtures("qwen3_vl")
    ids, inputs, encoded = vlm.prompt([noise_image(21)], "Tell me.")
    engine = vlm.engine(max_num_seqs=4, block_size=4, max_num_batched_tokens=6)
    engine.add_request(
        "g", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, n=2, logprobs=1), images=inputs
    )
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7)
    engine.add_request("s", ids, sampled, images=inputs)
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    want = vlm.expected(encoded)
    assert [c.token_ids for c in done["g"].outputs] == [want, want]
    assert all(len(c.logprobs) == len(c.token_ids) > 0 for c in done["g"].outputs)
    again = vlm.engine(max_num_seqs=4, block_size=4)
    out = None
    again.add_request("s", ids, sampled, images=inputs)
    while again.has_unfinished():
        for o in again.step():
            out = o
    assert out.outputs[0].token_ids == done["s"].outputs[0].token_ids


def test_repeated_image_hits_the_prefix_cache_and_another_image_does_not(vlm):
    """The same image under another question reuses the blocks over the image; a different image in the
    same place computes its own (its placeholder tokens are the same ids, its content hash is not)."""
    engine = vlm.engine(max_num_seqs=4, block_size=4)
    first, second, other = (
        vlm.prompt([image], question)
        for image, question in [
            (noise_image(7), "Describe it."),
            (noise_image(7), "Name a colour in it."),
            (noise_image(8), "Name a colour in it."),
        ]
    )
    cached = []
    for i, (ids, inputs, encoded) in enumerate([first, second, other]):
        (out,) = run_outputs(engine, [(ids, inputs, None)])
        assert out.outputs[0].token_ids == vlm.expected(encoded), f"prompt {i}"
        cached.append(out.metrics.num_cached_tokens)
    image_end = max(i for i, t in enumerate(second[0]) if t == engine.vision.image_token_id) + 1
    assert cached[1] >= image_end - image_end % 4, "the repeated image was computed again"
    assert cached[2] < first[0].index(engine.vision.image_token_id) + 4, (
        "another image took the cached blocks"
    )


def test_a_vision_model_folder_loads_with_its_processor_and_a_text_model_keeps_its_path(
    family_dirs, tmp_path
):
    engine = Engine.from_pretrained(str(family_dirs("llava")), device="cpu", num_kv_blocks=8)
    assert engine.accepts_images and type(engine.vision.vlm).__name__ == "LlavaForConditionalGeneration"
    assert type(engine.processor).__name__ == "LlavaProcessor"
    text = Engine.from_pretrained(
        str(build_tiny_model(tmp_path / "llama", "llama")), device="cpu", num_kv_blocks=8
    )
    assert (
        not text.accepts_images and text.processor is None and type(text.model).__name__ == "LlamaForCausalLM"
    )


def test_a_text_model_refuses_images(tmp_path):
    path = build_tiny_model(tmp_path / "llama", "llama")
    engine = Engine.from_pretrained(str(path), device="cpu", dtype="float32", num_kv_blocks=8)
    fx_image = noise_image(1)
    from bulkgen.engine.features.multimodal import ImageInputs, image_hash

    inputs = ImageInputs(torch.zeros(1, 3, 4, 4), [image_hash(fx_image)])
    with pytest.raises(ValueError, match="takes no images"):
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1), images=inputs)


@pytest.mark.parametrize(
    "config_name, architecture, why",
    [
        ("PaliGemmaConfig", "PaliGemmaForConditionalGeneration", "not yet checked"),
    ],
)
def test_unchecked_vision_families_are_refused_by_name_before_loading(
    tmp_path, config_name, architecture, why
):
    import transformers

    getattr(transformers, config_name)(architectures=[architecture]).save_pretrained(tmp_path)  # no weights
    with pytest.raises(ValueError, match=f"{architecture}: bulkgen does not run .*{why}"):
        Engine.from_pretrained(str(tmp_path), device="cpu")


def test_a_chat_line_with_images_prepares_to_transformers_inputs_and_counts_image_tokens(fixtures):
    """A parsed chat line whose content holds `{"type": "image"}` parts (as the request parser leaves it),
    prepared by the worker's path: the ids are the processor's, its image tokens are prompt tokens in the
    usage the result reports, and the engine answers with transformers' tokens."""
    from bulkgen.batch.prepare import tokenize_with_images
    from bulkgen.batch.requests import ParsedRequest
    from bulkgen.runtime.held import result_dict

    vlm = fixtures("llava")
    images = [noise_image(11), noise_image(12, (50, 20))]
    content = [{"type": "text", "text": "First "}, {"type": "image"}, {"type": "text", "text": " then "}]
    content.append({"type": "image"})
    request = ParsedRequest(
        "c1", 0, "m", "/v1/chat/completions", messages=[{"role": "user", "content": content}]
    )
    ids, inputs = tokenize_with_images(request, vlm.processor, images)
    text = vlm.processor.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=False)
    encoded = vlm.processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    assert ids == encoded["input_ids"][0].tolist()
    engine = vlm.engine(max_num_seqs=2, block_size=4)
    (out,) = run_outputs(engine, [(ids, inputs, None)])
    assert out.outputs[0].token_ids == vlm.expected(encoded)
    image_tokens = ids.count(engine.vision.image_token_id)
    assert image_tokens == sum(inputs.token_counts) > 0
    text_only, _ = tokenize_with_images(request, vlm.processor, [])  # one placeholder token an image
    assert result_dict(out)["prompt_tokens"] == len(ids) == len(text_only) - 2 + image_tokens
