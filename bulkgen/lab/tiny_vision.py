"""Tiny, deterministic random-weight vision-language models with a locally saved processor: the engine's
vision fixtures. Nothing is downloaded: the tokenizer is lab/tiny.py's byte-level one plus the family's
image tokens, the image processor is built from its class with tiny sizes, and the weights come from the
config under a fixed seed.
"""

from __future__ import annotations

from pathlib import Path

from bulkgen.lab.tiny import build_tokenizer


def chat_template(image: str) -> str:
    """tiny.py's roles, with each image part rendered as `image`, the placeholder the processor expands."""
    return (
        "{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
        "{% if p['type'] == 'image' %}" + image + "{% else %}{{ p['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )


def _text_settings(tok, hidden_size: int) -> dict:
    return dict(
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


def _llava(tok, hidden_size: int):
    """LLaVA: a CLIP encoder (28-pixel images, 14-pixel patches: 4 tokens an image) and a Llama."""
    import transformers as tf

    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    config = tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        text_config=tf.LlamaConfig(**_text_settings(tok, hidden_size)),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    images = tf.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = tf.LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=chat_template("<image>"),
    )
    return tf.LlavaForConditionalGeneration(config), processor


BUILDERS = {"llava": _llava}
VISION_FAMILIES = tuple(BUILDERS)


def build_tiny_vlm(path: str | Path, family: str = "llava", *, seed: int = 0, hidden_size: int = 64) -> Path:
    """Write a random (seeded) vision-language model of `family` and its processor to `path`."""
    if family not in BUILDERS:
        raise ValueError(f"unknown tiny vision family {family!r}; choose one of {list(VISION_FAMILIES)}")
    import torch

    tok = build_tokenizer()
    torch.manual_seed(seed)
    model, processor = BUILDERS[family](tok, hidden_size)
    model = model.to(torch.float32).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path
