"""Qwen-VL and SmolVLM checkpoints as users have them (processor files with a video processor config:
lab/hub_processor.py), loaded on this machine, which has no torchvision: multimodal.load_processor builds
their processor without the video processor (engine/features/image_only.py), with the checkpoint's own settings and
chat template, so it prepares an image as the tiny builder's processor does, and Engine.from_pretrained and
`bulkgen plan` run the checkpoint with it. Images are made here with PIL from seeded noise.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.utils import is_torchvision_available

from bulkgen.cli import cli
from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.features.multimodal import load_processor, process
from bulkgen.lab.hub_processor import HUB_LAYOUTS, HUB_PROCESSORS, write_hub_processor
from bulkgen.lab.tiny_vision import build_tiny_vlm
from bulkgen.lab.tiny_vision import load_processor as builder_processor
from bulkgen.plan import profile as profiles
from bulkgen.store import open_store
from tests.support.images import data_url
from tests.support.service import write_jsonl

# the canary runs it on the newest releases; not the lower bound (docs/limits.md)
pytestmark = pytest.mark.canary

FAMILIES = tuple(HUB_PROCESSORS)
MAX_TOKENS = 6


def noise_image(seed: int, size: tuple[int, int]) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=gen) * 255).to(torch.uint8)
    return Image.fromarray(pixels.numpy())


# a small image, and one over the tiny Qwen models' max_pixels (a processor with the class's default
# limits would give it many more tokens) and over SmolVLM's tile size (split into tiles)
IMAGES = [noise_image(1, (40, 30)), noise_image(2, (200, 150))]


@pytest.fixture(scope="module")
def built(tiny_model):
    """family -> the folder build_tiny_vlm wrote (its processor files without a video processor)."""
    return {family: tiny_model(family, seed=5, builder=build_tiny_vlm) for family in FAMILIES}


@pytest.fixture(scope="module")
def checkpoint(built, tmp_path_factory):
    """(family, layout) -> a copy of the built folder with its processor files in that hub layout."""
    root, made = tmp_path_factory.mktemp("hub"), {}

    def get(family: str, layout: str = "hub"):
        if (family, layout) not in made:
            copy = shutil.copytree(built[family], root / f"{family}-{layout}")
            made[family, layout] = write_hub_processor(copy, layout)
        return made[family, layout]

    return get


def chat(processor, images: list) -> str:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What is this?"}]
    return processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


@pytest.mark.parametrize("layout", HUB_LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_with_a_video_processor_loads_and_prepares_images_as_the_builder(
    family, layout, built, checkpoint
):
    path = checkpoint(family, layout)
    files = sorted(p.name for p in path.iterdir() if "processor" in p.name or "chat_template" in p.name)
    assert "video_preprocessor_config.json" in files or "video_processor" in json.loads(
        (path / "processor_config.json").read_text()
    ), files
    if not is_torchvision_available():  # why bulkgen builds it: transformers' own cannot be built here
        with pytest.raises(ImportError, match="Torchvision"):
            AutoProcessor.from_pretrained(path, local_files_only=True)
    processor, reference = load_processor(str(path)), builder_processor(built[family])
    assert type(processor).__name__ == HUB_PROCESSORS[family][0]
    if not is_torchvision_available():
        assert type(processor.image_processor).__name__.endswith("ImageProcessorPil")
        assert "video_processor" not in processor.to_dict()
    text = chat(processor, IMAGES)
    assert text == chat(reference, IMAGES)  # the checkpoint's chat template
    for images in ([IMAGES[0]], [IMAGES[1]], IMAGES):
        ids, inputs = process(processor, text if len(images) == 2 else chat(processor, images), images)
        want_ids, want = process(reference, text if len(images) == 2 else chat(reference, images), images)
        assert ids == want_ids
        assert torch.equal(inputs.pixel_values, want.pixel_values)
        assert inputs.token_counts == want.token_counts
        assert inputs.extras.keys() == want.extras.keys()
        assert all(torch.equal(inputs.extras[k], want.extras[k]) for k in want.extras)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_processor_saves_as_its_class_with_its_settings_and_loads_back(family, checkpoint, tmp_path):
    processor = load_processor(str(checkpoint(family)))
    saved = shutil.copytree(checkpoint(family), tmp_path / "saved")
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "chat_template.json"):
        (saved / name).unlink()
    processor.save_pretrained(saved)
    written = json.loads((saved / "processor_config.json").read_text())
    assert written["processor_class"] == HUB_PROCESSORS[family][0]
    if family == "smolvlm":
        assert written["image_seq_len"] == 4
    again = load_processor(str(saved))
    text = chat(processor, IMAGES)
    assert chat(again, IMAGES) == text
    (ids, inputs), (want_ids, want) = process(again, text, IMAGES), process(processor, text, IMAGES)
    assert ids == want_ids and torch.equal(inputs.pixel_values, want.pixel_values)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_from_pretrained_runs_the_checkpoint_as_transformers_generates(family, built, checkpoint):
    path = checkpoint(family)
    engine = Engine.from_pretrained(str(path), device="cpu", max_num_seqs=2)
    assert type(engine.vision.processor).__name__ == HUB_PROCESSORS[family][0]
    reference = builder_processor(built[family])
    text = chat(reference, [IMAGES[1]])
    ids, inputs = process(engine.vision.processor, text, [IMAGES[1]])
    engine.add_request("0", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), images=inputs)
    while engine.has_unfinished():
        outputs = engine.step()
    encoded = reference(text=text, images=[IMAGES[1]], return_tensors="pt", add_special_tokens=False)
    model = AutoModelForImageTextToText.from_pretrained(built[family], local_files_only=True).eval()
    with torch.no_grad():
        want = model.generate(**encoded, max_new_tokens=MAX_TOKENS, do_sample=False)
    assert outputs[0].outputs[0].token_ids == want[0, encoded["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_bulkgen_plan_counts_the_checkpoints_image_tokens(family, built, checkpoint, tmp_path):
    path, name = checkpoint(family), "tiny-vlm"
    storage = tmp_path / "storage"
    storage.mkdir()
    stored = profiles.Profile(name, "cpu", 0.004, 1e-4, 8e-5, 1e-6, 64, 2048, 512, 16, 0.4)
    profiles.save(open_store(str(storage)), stored)
    png = tmp_path / "image.png"
    IMAGES[1].save(png)
    part = {"type": "image_url", "image_url": {"url": data_url(png.read_bytes())}}
    body = {"model": name, "messages": [{"role": "user", "content": [part]}], "max_tokens": 4}
    rows = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}]
    args = ["plan", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--storage", str(storage)]
    result = CliRunner().invoke(cli, [*args, "--gpu", "cpu", "--model", f"{name}={path}", "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    reference = builder_processor(built[family])
    ids, _ = process(reference, chat(reference, [IMAGES[1]]), [Image.open(png)])
    assert (plan["encoder"]["images"], plan["encoder"]["image_tokens"]) == (
        1,
        ids.count(reference.image_token_id),
    )
