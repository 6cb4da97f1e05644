"""Quantized vision-language models: online FP8 (`quantize="fp8"`) and a compressed-tensors FP8 checkpoint
on the tiny LLaVA and Qwen2.5-VL (bulkgen.lab.tiny_vision). Only the text model's decoder layers are
quantized; the vision tower and projector stay float. The engine's greedy tokens for a batch mixing a
text-only prompt, one image, two images and the same image twice (packed, image runs split across
chunks) equal transformers' `generate` over the same quantized modules, each prompt alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.features.multimodal import VisionTower, process, text_model
from bulkgen.engine.model.loading import load_model
from bulkgen.engine.model.quantize import Fp8Linear, decoder_layers, quantize_layers, weight_bytes
from bulkgen.engine.model.weight_format import FP8_E4M3, served_weights
from bulkgen.lab.quantized import write_compressed_fp8
from bulkgen.lab.tiny_vision import build_tiny_vlm, load_processor
from tests.engine.test_vision import noise_image

FAMILIES = ["llava", "qwen2_5_vl"]
MAX_TOKENS = 5
VISION_PREFIXES = ("visual.", "vision_tower.", "multi_modal_projector.")
CASES = [
    ([], "Say something."),
    ([noise_image(1)], "What is in this picture?"),
    ([noise_image(2), noise_image(3, (24, 50))], "Compare the two."),
    ([noise_image(4), noise_image(4)], "Are these equal?"),
]


@pytest.fixture(scope="module")
def float_dirs(tiny_model):
    return {family: tiny_model(family, seed=5, builder=build_tiny_vlm) for family in FAMILIES}


@pytest.fixture(scope="module")
def fp8_dirs(float_dirs, tmp_path_factory):
    """Each tiny VLM as a compressed-tensors FP8 checkpoint (per-channel scales), vision tower ignored."""
    root = tmp_path_factory.mktemp("vision-ct-fp8")
    return {family: write_compressed_fp8(path, root / family) for family, path in float_dirs.items()}


def vision_modules(vlm) -> list[torch.nn.Module]:
    """Everything of the model beside its text model: the vision tower and the projector."""
    language = vlm.get_decoder()
    return [child for child in vlm.model.children() if child is not language]


def batch(processor) -> list[tuple[list[int], object, dict]]:
    """(ids, the engine's image inputs, the processor's inputs for `generate`) of each case."""
    out = []
    for images, question in CASES:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        ids, inputs = process(processor, text, images)
        encoded = processor(text=text, images=images or None, return_tensors="pt", add_special_tokens=False)
        out.append((ids, inputs, encoded))
    return out


def generate(model, encoded: dict) -> list[int]:
    with torch.no_grad():
        encoded = {k: v.to(model.device) for k, v in encoded.items()}
        out = model.generate(**encoded, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, encoded["input_ids"].shape[1] :].tolist()


def engine_tokens(vlm, processor, cases, **engine_kwargs) -> list[list[int]]:
    """The cases' greedy tokens from one engine over `vlm` (assembled as Engine.from_pretrained does:
    the tiny Qwen-VL processor cannot be loaded back from its folder), a step budget that splits image
    runs across prefill chunks. The service's `quantize="fp8"` is given, as a worker gives it to every
    model it serves: a model already quantized keeps its modules."""
    engine = Engine(
        text_model(vlm),
        processor.tokenizer,
        vision=VisionTower(vlm, processor),
        max_num_seqs=4,
        block_size=4,
        max_num_batched_tokens=7,
        quantize="fp8",
        **engine_kwargs,
    )
    assert sum(isinstance(m, Fp8Linear) for m in engine.model.modules()) in (0, 7 * len(decoder_layers(vlm)))
    for i, (ids, inputs, _) in enumerate(cases):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), images=inputs)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(cases))]


def first_logits(model, encoded: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**encoded).logits[0, -1]


@pytest.mark.parametrize("family", FAMILIES)
def test_online_fp8_quantizes_the_text_layers_only_and_equals_generate(family, float_dirs):
    """`quantize="fp8"` on a float VLM: every decoder-layer linear of the text model is an Fp8Linear, the
    vision tower and projector keep their float weights bit for bit, the text layers' weight bytes drop,
    and the engine's tokens are transformers' over the same online-quantized modules."""
    path = float_dirs[family]
    processor = load_processor(path)
    cases = batch(processor)
    float_vlm = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval()
    hf = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval()
    quantize_layers(hf, "cpu")
    vlm = load_model(path, "cpu", torch.float32, "fp8", vision=True)

    layers = decoder_layers(vlm)
    assert sum(isinstance(m, Fp8Linear) for m in vlm.modules()) == 7 * len(layers)
    assert weight_bytes(layers) < 0.3 * weight_bytes(decoder_layers(float_vlm))
    for tower, float_tower in zip(vision_modules(vlm), vision_modules(float_vlm), strict=True):
        assert not any(isinstance(m, Fp8Linear) for m in tower.modules())
        for (name, p), q in zip(tower.named_parameters(), float_tower.parameters(), strict=True):
            assert p.dtype == torch.float32 and torch.equal(p, q), name
    # the reference is the quantized model, not the float one: FP8 rounding moves its logits
    image_case = cases[1][2]
    assert (first_logits(hf, image_case) - first_logits(float_vlm, image_case)).abs().max() > 1e-3

    assert engine_tokens(vlm, processor, cases) == [generate(hf, encoded) for *_, encoded in cases]


def _stored(path) -> dict[str, str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}


@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_tensors_fp8_vlm_loads_through_its_quantizer_and_equals_generate(
    family, float_dirs, fp8_dirs
):
    """A compressed-tensors FP8 VLM (the text model's linears in e4m3, the vision tower and projector in
    the ignore list, stored float) loads through transformers' quantizer into the engine, which gives
    transformers' own greedy tokens on that checkpoint; /v1/models reports its format."""
    path = fp8_dirs[family]
    stored = _stored(path)
    # saved in the hub's layout, as transformers writes it back (`visual.`, `language_model.model.`)
    vision_weights = [n for n in stored if n.startswith(VISION_PREFIXES) and n.endswith("weight")]
    text_weights = [
        n for n in stored if "layers." in n and n.endswith("proj.weight") and n not in vision_weights
    ]
    assert text_weights and vision_weights
    assert all(stored[n] == "F8_E4M3" and f"{n}_scale" in stored for n in text_weights)
    assert all(stored[n] == "BF16" and f"{n}_scale" not in stored for n in vision_weights)
    ignore = json.loads((path / "config.json").read_text())["quantization_config"]["ignore"]
    linears = {
        n.removesuffix(".weight") for n in vision_weights if not any(k in n for k in ("norm", "embed", "ln_"))
    }
    assert linears and linears <= set(ignore)

    processor = load_processor(path)
    cases = batch(processor)
    # transformers' own from_pretrained matches the hub-layout ignore list against its renamed modules
    # and misses (the vision tower gets FP8 schemes with uninitialised scales: NaN logits), so the
    # reference is transformers' generate over bulkgen's load of the checkpoint, checked here against it
    hf = load_model(path, "cpu", torch.float32, vision=True)
    vlm = load_model(path, "cpu", torch.float32, "fp8", vision=True)  # its own format wins over "fp8"
    assert vlm.hf_quantizer is not None
    quantized = [m for m in vlm.modules() if getattr(m, "quantization_scheme", None) is not None]
    assert len(quantized) == 7 * len(decoder_layers(vlm))
    vision = {n: p for t in vision_modules(vlm) for n, p in t.named_parameters()}
    assert not any(getattr(m, "quantization_scheme", None) for t in vision_modules(vlm) for m in t.modules())
    assert vision and not any(n.endswith("_scale") for n in vision)
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # the stored bf16 weights, as stored
        for name in vision_weights:
            held = vlm.get_parameter(_model_name(vlm, name))
            assert torch.equal(held, f.get_tensor(name).float()), name
    float_vlm = AutoModelForImageTextToText.from_pretrained(float_dirs[family], local_files_only=True).eval()
    assert (first_logits(hf, cases[1][2]) - first_logits(float_vlm, cases[1][2])).abs().max() > 1e-3

    assert engine_tokens(vlm, processor, cases) == [generate(hf, encoded) for *_, encoded in cases]
    assert not any(isinstance(m, Fp8Linear) for m in vlm.modules())  # not quantized again online
    assert served_weights(path, "fp8") == {
        "quantization": "compressed-tensors",
        "weight_dtype": FP8_E4M3,
        "kv_cache_dtype": "auto",
    }


def _model_name(vlm, stored: str) -> str:
    """A stored (hub-layout) weight name as the loaded model names it: `model.` before its tower."""
    names = dict(vlm.named_parameters())
    return stored if stored in names else f"model.{stored}"


def test_engine_from_pretrained_quantizes_a_vision_model_online(float_dirs):
    """Engine.from_pretrained takes `quantize="fp8"` for a vision-language model (it was refused): the
    engine's text model runs Fp8Linear layers, its encoder none, and it still accepts images."""
    path = float_dirs["llava"]
    engine = Engine.from_pretrained(str(path), device="cpu", quantize="fp8", num_kv_blocks=16)
    assert engine.accepts_images
    assert sum(isinstance(m, Fp8Linear) for m in engine.model.modules()) == 7 * len(
        decoder_layers(engine.model)
    )
    assert not any(isinstance(m, Fp8Linear) for t in vision_modules(engine.vision.vlm) for m in t.modules())
    assert served_weights(path, "fp8")["quantization"] == "fp8-online"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_fp32_online_fp8_vision_model_equals_generate(family, float_dirs):
    """On CUDA in fp32 (no row-wise FP8 GEMM: the dequantized product) the engine's tokens are still
    transformers' over the same online-quantized modules, the encoder running float on the device."""
    path = float_dirs[family]
    processor = load_processor(path)
    cases = batch(processor)
    hf = AutoModelForImageTextToText.from_pretrained(path, local_files_only=True).eval()
    quantize_layers(hf, "cuda")
    vlm = load_model(path, "cuda", torch.float32, "fp8", vision=True)
    assert all(p.is_cuda and p.dtype == torch.float32 for t in vision_modules(vlm) for p in t.parameters())
    got = engine_tokens(vlm, processor, cases, num_kv_blocks=256)
    assert got == [generate(hf, encoded) for *_, encoded in cases]
