"""A vision-language checkpoint's processor without its video processor, where torchvision is missing.

transformers' Qwen2-VL, Qwen2.5-VL, Qwen3-VL and SmolVLM processors take a video processor beside the image
processor, and AutoProcessor always builds one: from the checkpoint's `video_preprocessor_config.json`, the
`video_processor` entry of its `processor_config.json`, or else its image processor's config. Every video
processor imports torchvision, which a CPU torch has none of (the PyPI torchvision wheel is a CUDA build), so
AutoProcessor cannot load these checkpoints there. bulkgen takes no video (a line's parts are text and
images), so `load_image_only` builds the checkpoint's own processor class from its own files (settings,
chat template, tokenizer) with the PIL image processor AutoImageProcessor picks without torchvision
(`image_processing_pil_*`) and no video processor. Its image tokens and pixels are the full processor's.
"""

from __future__ import annotations

import inspect
import json
from functools import cache
from pathlib import Path

from transformers.processing_utils import ProcessorMixin
from transformers.utils import is_torchvision_available

# the parts, in `__init__`'s order, of the processors built here without the last; one with other parts
# (audio) is left to AutoProcessor
PARTS = ["image_processor", "tokenizer", "video_processor"]


def load_image_only(path: str) -> ProcessorMixin | None:
    """The processor of the checkpoint at `path` without its video processor, where torchvision is missing
    and the checkpoint's processor class takes one; None otherwise (AutoProcessor then loads it whole)."""
    if is_torchvision_available():
        return None
    cls = _class_named(processor_class(path))
    if cls is None or cls.get_attributes() != PARTS:
        return None
    image_only = without_video(cls)
    processor_dict, kwargs = cls.get_processor_dict(path, local_files_only=True)
    accepted = set(inspect.signature(image_only.__init__).parameters) - {"self", *PARTS}
    settings = {k: v for k, v in {**processor_dict, **kwargs}.items() if k in accepted}
    return image_only(_image_processor(path), _tokenizer(path), **settings)


@cache
def without_video(base: type[ProcessorMixin]) -> type[ProcessorMixin]:
    """`base` (a processor class whose parts are PARTS) without its video processor: transformers checks
    and saves the parts and settings its `__init__` names. It keeps the base's name, so it saves as the base
    class and a folder it wrote loads with transformers' own processor where torchvision exists."""

    def __init__(self, image_processor=None, tokenizer=None, **settings):
        base.__init__(self, image_processor, tokenizer, None, **settings)

    # the base's parameters less the video processor: what transformers reads as the parts and the
    # settings to save (SmolVLM's image_seq_len)
    signature = inspect.signature(base.__init__)
    kept = [p for name, p in signature.parameters.items() if name != "video_processor"]
    __init__.__signature__ = signature.replace(parameters=kept)
    body = {"__init__": __init__, "__doc__": without_video.__doc__, "__module__": __name__}
    if base.apply_chat_template is not ProcessorMixin.apply_chat_template:
        # SmolVLM's override only adds video defaults (frames, fps), read from the absent video processor
        body["apply_chat_template"] = ProcessorMixin.apply_chat_template
    return type(base.__name__, (base,), body)


def _image_processor(path: str):
    """As AutoProcessor loads it: the PIL image processor where torchvision is missing."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path, local_files_only=True)


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _class_named(name: str | None) -> type[ProcessorMixin] | None:
    """transformers' processor class of that name; None for a name it has not, or cannot import here."""
    import transformers

    try:
        cls = getattr(transformers, name) if name else None
    except (AttributeError, ImportError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, ProcessorMixin) else None


def processor_class(path: str) -> str | None:
    """The processor class a checkpoint names where AutoProcessor looks first (its processor, image
    processor and tokenizer configs), else the one transformers maps its model type to."""
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        file = Path(path) / name
        if file.is_file() and (named := json.loads(file.read_text()).get("processor_class")):
            return named
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    return PROCESSOR_MAPPING_NAMES.get(AutoConfig.from_pretrained(path, local_files_only=True).model_type)
