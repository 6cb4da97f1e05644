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


# the vision encoders of the CLIP / SigLIP kind: 2 layers of width 32
ENCODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


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
        # 5x transformers' default spread: sharp enough attention that a wrong position or a misplaced
        # image embedding changes greedy tokens (at the default a 29-token prompt's logits moved by 2e-3)
        initializer_range=0.1,
    )


def _llava(tok, hidden_size: int):
    """LLaVA: a CLIP encoder (28-pixel images, 14-pixel patches: 4 tokens an image) and a Llama."""
    import transformers as tf

    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    config = tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(**ENCODER, image_size=28, patch_size=14),
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


QWEN_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _qwen_ids(tok) -> dict:
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return {name: tok.convert_tokens_to_ids(t) for name, t in zip(names, QWEN_SPECIALS, strict=True)}


def _qwen_vision(patch: int, hidden_size: int, **settings) -> dict:
    return dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=hidden_size,
        patch_size=patch,
        spatial_merge_size=2,
        temporal_patch_size=2,
        # 10x the default spread: Qwen3-VL's deepstack rows then change greedy tokens (at the default
        # they moved its logits by 0.16 and no argmax), so a test without them fails
        initializer_range=0.2,
        **settings,
    )


def _qwen_images(patch: int):
    """Qwen-VL's image processor: 4 to 16 merged tokens an image."""
    import transformers as tf

    side = 2 * patch  # the pixels of one merged token
    return tf.Qwen2VLImageProcessorPil(
        min_pixels=side * side * 4,
        max_pixels=side * side * 16,
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
    )


def _qwen2_5_vl(tok, hidden_size: int):
    """Qwen2.5-VL: its windowed ViT (14-pixel patches merged 2 x 2) and its M-RoPE text model (3-D
    positions split 2/3/3 over the rotary pairs of 16-wide heads)."""
    import transformers as tf

    ids = _qwen_ids(tok)
    text = _text_settings(tok, hidden_size)
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    vision = _qwen_vision(14, hidden_size, window_size=56, fullatt_block_indexes=[1])
    config = tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    model = tf.Qwen2_5_VLForConditionalGeneration(config)
    return model, image_only_qwen_processor(config.model_type, _qwen_images(14), tok)


def _qwen3_vl(tok, hidden_size: int):
    """Qwen3-VL: its ViT (16-pixel patches merged 2 x 2) whose deepstack features are added to the first
    two decoder layers' hidden states at the image tokens, and its interleaved M-RoPE text model."""
    import transformers as tf

    ids = _qwen_ids(tok)
    text = _text_settings(tok, hidden_size)
    text["head_dim"] = 16
    text["rope_parameters"] = {
        "rope_type": "default",
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
        "rope_theta": 10000.0,
    }
    vision = _qwen_vision(16, hidden_size, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    config = tf.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    model = tf.Qwen3VLForConditionalGeneration(config)
    return model, image_only_qwen_processor(config.model_type, _qwen_images(16), tok)


def _qwen2_vl(tok, hidden_size: int):
    """Qwen2-VL: its ViT (14-pixel patches merged 2 x 2, width `embed_dim`, no windows) and the M-RoPE text
    model Qwen2.5-VL kept (3-D positions split 2/3/3 over the rotary pairs of 16-wide heads)."""
    import transformers as tf

    ids = _qwen_ids(tok)
    text = _text_settings(tok, hidden_size)
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    vision = dict(
        depth=2, embed_dim=32, mlp_ratio=2, num_heads=2, hidden_size=hidden_size, initializer_range=0.2
    )
    config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    model = tf.Qwen2VLForConditionalGeneration(config)
    return model, image_only_qwen_processor(config.model_type, _qwen_images(14), tok)


def image_only_qwen_processor(model_type: str, image_processor, tokenizer):
    """Qwen-VL's own processor (its placeholder expansion, its mm_token_type_ids) without the video
    processor, which needs torchvision (not installed here), as multimodal.load_processor builds it there
    (engine/features/image_only.py); `load_processor` builds it again from the folder's image processor alone."""
    import transformers as tf

    from bulkgen.engine.features.image_only import without_video

    base = {
        "qwen2_vl": tf.Qwen2VLProcessor,
        "qwen2_5_vl": tf.Qwen2_5_VLProcessor,
        "qwen3_vl": tf.Qwen3VLProcessor,
    }[model_type]
    return without_video(base)(image_processor, tokenizer, chat_template=chat_template(QWEN_IMAGE))


QWEN_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def load_processor(path: str | Path):
    """The processor of a tiny vision model written by build_tiny_vlm: the one serving loads
    (multimodal.load_processor), except Qwen-VL's and SmolVLM's, built again without a video processor."""
    import transformers as tf

    from bulkgen.engine.features import multimodal

    config = tf.AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type == "smolvlm":
        images = tf.SmolVLMImageProcessorPil.from_pretrained(path, local_files_only=True)
        return image_only_smolvlm_processor(
            images, tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
        )
    if config.model_type not in QWEN_TYPES:
        return multimodal.load_processor(path)
    images = tf.Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
    tok = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return image_only_qwen_processor(config.model_type, images, tok)


def _tiled(tok, hidden_size: int, config_class, images_class) -> tuple:
    """(config, image processor) of the Idefics3 layout SmolVLM shares: a SigLIP-style encoder on 56-pixel
    tiles (an image up to 112 pixels split into tiles plus a global view), pixel-shuffled 2 x 2 into 4
    tokens a tile, framed by row/column and global-image tokens."""
    import transformers as tf

    tiles = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *tiles]
    tok.add_special_tokens({"additional_special_tokens": specials})
    config = config_class(
        vision_config=dict(**ENCODER, image_size=56, patch_size=14),
        text_config=tf.LlamaConfig(**_text_settings(tok, hidden_size)),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        scale_factor=2,
        tie_word_embeddings=False,
    )
    images = images_class(
        size={"longest_edge": 112}, max_image_size={"longest_edge": 56}, do_image_splitting=True
    )
    return config, images


def _idefics3(tok, hidden_size: int):
    """Idefics3 (`_tiled`'s layout) with its own processor."""
    import transformers as tf

    config, images = _tiled(tok, hidden_size, tf.Idefics3Config, tf.Idefics3ImageProcessorPil)
    processor = tf.Idefics3Processor(
        image_processor=images, tokenizer=tok, image_seq_len=4, chat_template=chat_template("<image>")
    )
    return tf.Idefics3ForConditionalGeneration(config), processor


def _smolvlm(tok, hidden_size: int):
    """SmolVLM: Idefics3's layout (`_tiled`) under SmolVLM's own classes and processor, without its video
    processor (which needs torchvision, not installed here)."""
    import transformers as tf

    config, images = _tiled(tok, hidden_size, tf.SmolVLMConfig, tf.SmolVLMImageProcessorPil)
    return tf.SmolVLMForConditionalGeneration(config), image_only_smolvlm_processor(images, tok)


def image_only_smolvlm_processor(image_processor, tokenizer):
    """SmolVLM's own processor (its placeholder expansion) without the video processor, as
    multimodal.load_processor builds it without torchvision (engine/features/image_only.py)."""
    import transformers as tf

    from bulkgen.engine.features.image_only import without_video

    return without_video(tf.SmolVLMProcessor)(
        image_processor, tokenizer, image_seq_len=4, chat_template=chat_template("<image>")
    )


def _mistral3(tok, hidden_size: int):
    """Mistral 3: a Pixtral encoder (7-pixel patches, 2-D RoPE, images up to 56 pixels) whose patches the
    projector merges 2 x 2 into up to 4 x 4 tokens, laid out by the processor as rows of [IMG] ending in
    [IMG_BREAK] and a final [IMG_END], and a Mistral text model. Its processor is transformers'
    PixtralProcessor where torchvision exists, bulkgen's mirror of it otherwise (engine/features/pixtral.py)."""
    import transformers as tf

    from bulkgen.engine.features.pixtral import pixtral_processor

    tok.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]})
    config = tf.Mistral3Config(
        vision_config=tf.PixtralVisionConfig(**ENCODER, image_size=56, patch_size=7, initializer_range=0.2),
        text_config=tf.MistralConfig(**_text_settings(tok, hidden_size), sliding_window=None),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    images = tf.PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size=7)
    processor = pixtral_processor(
        images, tok, patch_size=7, spatial_merge_size=2, chat_template=chat_template("[IMG]")
    )
    return tf.Mistral3ForConditionalGeneration(config), processor


GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}


def _gemma3(tok, hidden_size: int):
    """Gemma 3: a SigLIP encoder on 56-pixel images (14-pixel patches, 16 soft tokens an image, no pooling)
    framed by begin/end-of-image tokens, and its text model (sliding and full layers, embeddings scaled by
    sqrt(hidden)) whose image tokens attend to their whole image bidirectionally. The window of 6 is
    shorter than an image's 16 tokens, so the sliding layers' AND(window, OR(causal, image)) is exercised;
    pan-and-scan is off."""
    import torch
    import transformers as tf

    tok.add_special_tokens({"additional_special_tokens": list(GEMMA3_TOKENS.values())})
    # how transformers names a model's own special tokens (from_pretrained does this with extra token
    # keywords): the processor reads tokenizer.boi_token / image_token / eoi_token
    tok._set_model_specific_special_tokens(GEMMA3_TOKENS)
    text = _text_settings(tok, hidden_size)
    text.update(head_dim=16, query_pre_attn_scalar=16, sliding_window=6)
    text["layer_types"] = ["sliding_attention", "full_attention"]
    config = tf.Gemma3Config(
        text_config=tf.Gemma3TextConfig(**text),
        vision_config=tf.SiglipVisionConfig(**ENCODER, image_size=56, patch_size=14),
        mm_tokens_per_image=16,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        image_token_index=tok.image_token_id,
        tie_word_embeddings=False,
    )
    images = tf.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, do_pan_and_scan=False)
    processor = tf.Gemma3Processor(
        image_processor=images, tokenizer=tok, image_seq_length=16, chat_template=chat_template(tok.boi_token)
    )
    model = tf.Gemma3ForConditionalGeneration(config)
    # transformers starts the projector at zero (every image embedding zero); drawn instead, so that the
    # images, and how their tokens attend to each other, change greedy tokens
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.2)
    return model, processor


BUILDERS = {
    "llava": _llava,
    "idefics3": _idefics3,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "qwen2_vl": _qwen2_vl,
    "smolvlm": _smolvlm,
    "mistral3": _mistral3,
    "gemma3": _gemma3,
}
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
    tok.chat_template = processor.chat_template
    processor.save_pretrained(path)
    return path
