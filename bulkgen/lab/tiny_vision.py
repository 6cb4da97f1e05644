"""Tiny, deterministic random-weight vision-language models with a locally saved processor: the engine's
vision fixtures. Nothing is downloaded: the tokenizer is lab/tiny.py's byte-level one plus the family's
image placeholder, the image processor is built from its class with tiny sizes, and the weights come
from the config under a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

from bulkgen.lab.tiny import build_tokenizer

IMAGE_TOKEN = "<image>"
# the chat template of the tiny vision models: tiny.py's roles, with each image part as the placeholder
# the processor expands into the image's tokens
VISION_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}" + IMAGE_TOKEN + "{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
IMAGE_SIZE = 28  # pixels a side after preprocessing
PATCH = 14  # so 2 x 2 patches, 4 image tokens (LLaVA drops the CLS token)

VISION_FAMILIES = ("llava",)


def build_tiny_vlm(path: str | Path, family: str = "llava", *, seed: int = 0, hidden_size: int = 64) -> Path:
    """Write a random (seeded) vision-language model of `family` and its processor to `path`."""
    if family not in VISION_FAMILIES:
        raise ValueError(f"unknown tiny vision family {family!r}; choose one of {list(VISION_FAMILIES)}")
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    images = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
        chat_template=VISION_CHAT_TEMPLATE,
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
