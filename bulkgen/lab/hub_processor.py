"""A tiny vision model's processor files rewritten as a published checkpoint has them (lab/tiny_vision.py
writes them without a video processor, which transformers cannot build without torchvision): what
multimodal.load_processor must load on a machine without torchvision, as users' checkpoints are.
"""

from __future__ import annotations

import json
from pathlib import Path

# what a published checkpoint of each family names: its processor class and its video processor class
HUB_PROCESSORS = {
    "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
    "smolvlm": ("SmolVLMProcessor", "SmolVLMVideoProcessor"),
}
HUB_LAYOUTS = ("hub", "saved")


def write_hub_processor(path: str | Path, layout: str = "hub") -> Path:
    """Rewrite the processor files of a Qwen-VL or SmolVLM folder written by build_tiny_vlm as a real
    checkpoint has them, video processor included (transformers cannot build that here: every video
    processor imports torchvision), so that the folder tests what users load. `layout`:
    - "saved": what transformers' `save_pretrained` writes where torchvision exists: one
      processor_config.json nesting `image_processor` and `video_processor` beside the processor's own
      settings, and chat_template.jinja;
    - "hub": the per-file layout of the published checkpoints: preprocessor_config.json (the image settings
      and `processor_class`; Qwen2-VL's and Qwen2.5-VL's pixel limits as `min_pixels` / `max_pixels`),
      video_preprocessor_config.json, chat_template.json (the template also in tokenizer_config.json, as
      theirs have it), and a processor_config.json only for the processor's own settings (SmolVLM's
      `image_seq_len`).
    The video processor's entry mirrors the image settings under its class's `video_processor_type`, as the
    published Qwen-VL ones do (the same patch, merge and temporal sizes, mean and std)."""
    path = Path(path)
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    if model_type not in HUB_PROCESSORS or layout not in HUB_LAYOUTS:
        raise ValueError(
            f"no hub layout {layout!r} for {model_type!r}: {list(HUB_PROCESSORS)} x {HUB_LAYOUTS}"
        )
    name, video_name = HUB_PROCESSORS[model_type]
    settings = json.loads((path / "processor_config.json").read_text())
    image = settings.pop("image_processor")
    settings["processor_class"] = name
    video = {k: v for k, v in image.items() if k != "image_processor_type"}
    video["video_processor_type"] = video_name

    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    _write(path / "tokenizer_config.json", {**tokenizer_config, "processor_class": name})
    if layout == "saved":
        _write(
            path / "processor_config.json", {"image_processor": image, "video_processor": video, **settings}
        )
        return path
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        size = image.pop("size")
        image.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
    _write(path / "preprocessor_config.json", {**image, "processor_class": name})
    _write(path / "video_preprocessor_config.json", {**video, "processor_class": name})
    (path / "processor_config.json").unlink()
    if len(settings) > 1:
        _write(path / "processor_config.json", settings)
    template = path / "chat_template.jinja"
    _write(path / "chat_template.json", {"chat_template": template.read_text()})
    tokenizer_config.update(processor_class=name, chat_template=template.read_text())
    _write(path / "tokenizer_config.json", tokenizer_config)
    template.unlink()
    return path


def _write(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
