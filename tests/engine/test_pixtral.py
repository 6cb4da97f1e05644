"""Mistral 3's processor where transformers' PixtralProcessor cannot be imported (no torchvision): bulkgen's
mirror of it (engine/features/pixtral.py) prepares what transformers' own class prepares, and serving and `bulkgen
plan` both load it through multimodal.load_processor.

transformers' processing_pixtral.py imports one name from the torchvision image processor's module,
`get_resize_output_image_size`, which it uses only to count an image's tokens from its size. Where
torchvision is missing, the reference here is that very PixtralProcessor class, loaded with the PIL image
processor's module standing in for the torchvision one: it defines the same function (the two bodies are
the same code), so everything the class itself does is transformers' own.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
import transformers
from packaging.version import Version
from PIL import Image
from transformers.models.pixtral import image_processing_pil_pixtral
from transformers.utils import is_torchvision_available

from bulkgen.engine import Engine
from bulkgen.engine.features.multimodal import load_processor, process
from bulkgen.engine.features.pixtral import PixtralPilProcessor
from bulkgen.lab.tiny_vision import build_tiny_vlm

pytestmark = pytest.mark.upstream  # also on the lower bound and the canary (README: tested ranges)

# (width, height): below one merged patch, wider than tall, taller than wide, square, beyond the longest edge
SIZES = [(40, 30), (24, 50), (56, 56), (8, 60), (100, 13), (5, 5)]


def noise_image(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = torch.rand(size[1], size[0], 3, generator=torch.Generator().manual_seed(seed))
    return Image.fromarray((pixels * 255).to(torch.uint8).numpy())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("mistral3") / "model", "mistral3", seed=5)


@pytest.fixture
def transformers_processor_class(monkeypatch):
    """transformers' PixtralProcessor (the module docstring says how it loads without torchvision)."""
    name = "transformers.models.pixtral.processing_pixtral"
    if not is_torchvision_available():
        torchvision_module = "transformers.models.pixtral.image_processing_pixtral"
        monkeypatch.setitem(sys.modules, torchvision_module, image_processing_pil_pixtral)
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # its docstring decorator reads its source; gone after
    spec.loader.exec_module(module)
    return module.PixtralProcessor


def test_the_mirror_prepares_what_transformers_pixtral_processor_prepares(
    model_dir, transformers_processor_class
):
    mirror = load_processor(model_dir)
    if is_torchvision_available():  # transformers' own processor is loaded; the mirror is built here
        assert type(mirror).__name__ == "PixtralProcessor"
        mirror = PixtralPilProcessor(
            mirror.image_processor, mirror.tokenizer, patch_size=7, spatial_merge_size=2
        )
    assert type(mirror) is PixtralPilProcessor
    theirs = transformers_processor_class(
        mirror.image_processor, mirror.tokenizer, patch_size=7, spatial_merge_size=2
    )
    images = [noise_image(i, size) for i, size in enumerate(SIZES)]
    texts = ["[IMG]", "a [IMG] b [IMG] c", "[IMG][IMG][IMG] what differs?"]
    at = 0
    for text in texts:
        some = images[at : at + text.count("[IMG]")]
        at += len(some)
        ours, want = (p(text=text, images=some, return_tensors="pt") for p in (mirror, theirs))
        assert ours.keys() == want.keys() and all(torch.equal(ours[k], want[k]) for k in want), text
    sizes = [(i.height, i.width) for i in images]
    counts = mirror._get_num_multimodal_tokens(image_sizes=sizes)
    image_token = mirror.tokenizer.convert_tokens_to_ids("[IMG]")
    placeholders = [
        mirror(text="[IMG]", images=[image], return_tensors="pt")["input_ids"][0].tolist().count(image_token)
        for image in images
    ]
    assert counts.num_image_tokens == placeholders  # what the engine reads them for (multimodal._counts)
    if Version(transformers.__version__) >= Version("5.25"):  # earlier: each row's break and end counted too
        assert counts == theirs._get_num_multimodal_tokens(image_sizes=sizes)
    assert mirror.to_dict() == theirs.to_dict()  # saved alike: a saved mirror loads as PixtralProcessor
    saved = json.loads((model_dir / "processor_config.json").read_text())
    assert saved["processor_class"] == "PixtralProcessor"


def test_each_image_is_rows_of_img_tokens_each_row_closed_by_a_break_and_the_last_by_the_end(model_dir):
    """The layout the Mistral 3 model reads (its vision tower's patch grid, row by row), stated apart from
    either processor's code: an image resized to h x w merged patches of 14 pixels becomes h rows of w
    [IMG] tokens, each row followed by [IMG_BREAK] except the last, followed by [IMG_END]."""
    processor = load_processor(model_dir)
    tok = processor.tokenizer
    img, brk, end = tok.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    for i, size in enumerate(SIZES):
        ids, inputs = process(processor, "[IMG]", [noise_image(i, size)])
        height, width = (int(x) // 14 for x in inputs.extras["image_sizes"][0])
        assert ids == ([img] * width + [brk]) * (height - 1) + [img] * width + [end], size


def test_serving_and_the_plan_load_the_same_processor(model_dir, tmp_path):
    """`bulkgen serve`'s engine and `bulkgen plan`'s image reader both prepare a Mistral 3 prompt with the
    processor multimodal.load_processor gives, and agree on its tokens."""
    from bulkgen.cli.plan_cmds import _image_reader
    from bulkgen.store import open_store

    engine = Engine.from_pretrained(str(model_dir), device="cpu", num_kv_blocks=8)
    reader = _image_reader(str(model_dir), open_store(str(tmp_path)), ())
    want = type(load_processor(model_dir))
    assert type(engine.processor) is want and type(reader.processor) is want
    image = Image.new("RGB", (33, 47), (200, 10, 10))
    ids = [process(p, "[IMG] red?", [image])[0] for p in (engine.processor, reader.processor)]
    # 47 x 33 pixels, within the longest edge (56), round up to 4 x 3 merged patches of 14 pixels
    assert ids[0] == ids[1] and ids[0].count(engine.vision.image_token_id) == 4 * 3
