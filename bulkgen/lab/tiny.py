"""Tiny, deterministic random-weight Hugging Face models built from a config: test and benchmark fixtures.

Their text is noise by design (the engine-equality tests compare engines, not prose); the bundled default
model is trained instead, by jobs/train_tiny.py, which reuses SPECIAL_TOKENS and CHAT_TEMPLATE from here.

Nothing here touches a model hub. The tokenizer is byte-level BPE (every byte is a token, so any
text round-trips) plus a few special tokens and a chat template, which is all the service needs.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# `<|role|>\ntext<|end|>\n` per message; with tools, Hermes-style (as Qwen and Hermes models render them):
# a system block listing each tool's JSON schema inside <tools></tools>, an assistant's calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, a tool result as a `tool` turn. Without tools
# or calls it renders exactly as before tools were added (the bundled model was trained on that).
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\n"
    "You may call these tools, each given as a JSON schema:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'To call one, answer <tool_call>{"name": <its name>, "arguments": <its arguments as a JSON object>}'
    "</tool_call><|end|>\n"
    "{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

WINDOW = 32  # sliding windows and attention chunks of the tiny models: prompts of 100-300 tokens span several
_SLIDE_FULL = ["sliding_attention", "full_attention"]
_THREE_TO_ONE = ["sliding_attention"] * 3 + ["full_attention"]
_MOE = dict(num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
VOCAB = "vocab"  # a setting that must equal the tokenizer's vocabulary size
# multi-head latent attention: 4 heads of K 24 (16 + 8 rope) and V 16 over a 32-value latent
_MLA = dict(
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    num_key_value_heads=4,
)
_GLM_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1)


def _windowed(layer_types: list[str], **settings) -> dict:
    """A hybrid family's settings: WINDOW-token sliding layers where `layer_types` say, one layer each."""
    return {
        "sliding_window": WINDOW,
        "layer_types": layer_types,
        "num_hidden_layers": len(layer_types),
        **settings,
    }


# name -> (config class, model class, what the name means beyond the defaults: windows, MoE, MLA...).
# Layers of hybrid models follow their family's pattern, cut to 2 or 4 layers.
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # sliding windows on every layer or on some (layer_types), soft-capping, sinks, chunked attention
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", {"sliding_window": WINDOW, "head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": WINDOW}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {"sliding_window": WINDOW}),
    "qwen2-window": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", _windowed(_SLIDE_FULL, head_dim=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", _windowed(_THREE_TO_ONE, head_dim=16)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", _windowed(_SLIDE_FULL, head_dim=16, **_MOE)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", _windowed(_THREE_TO_ONE)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", _windowed(_THREE_TO_ONE, head_dim=16)),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", _windowed(_THREE_TO_ONE)),
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {
            "attention_chunk_size": WINDOW,
            "head_dim": 16,
            "num_hidden_layers": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 128,
            "interleave_moe_layer_step": 2,
        },
    ),
    # KV shared by the last layers (they read an earlier layer's K/V), AltUp and per-layer inputs
    "gemma3n": (
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        {
            "sliding_window": WINDOW,
            "head_dim": 16,
            "num_hidden_layers": 4,
            "layer_types": _SLIDE_FULL * 2,
            "num_kv_shared_layers": 2,
            "laurel_rank": 8,
            "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": VOCAB,
        },
    ),
    # multi-head latent attention (K and V heads of different sizes) and mixtures of experts
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **_MLA,
            "first_k_dense_replace": 1,
            **_GLM_MOE,
        },
    ),
    # DeepSeek-V2-Lite's shape: queries without a low-rank projection, rope by complex frequencies
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        {
            **_MLA,
            "q_lora_rank": None,
            "first_k_dense_replace": 1,
            **_GLM_MOE,
        },
    ),
    # GLM-4.7-Flash and Youtu-LLM: DeepSeek-V3's attention layer under other names
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        {
            **_MLA,
            "mlp_layer_types": ["dense", "sparse"],
            **_GLM_MOE,
        },
    ),
    "youtu": (
        "YoutuConfig",
        "YoutuForCausalLM",
        {
            **_MLA,
        },
    ),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_MOE)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {"first_k_dense_replace": 1, **_GLM_MOE}),
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # families the engine has run since before per-layer attention (no windows in these configs)
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"num_hidden_layers": 4}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "glm": ("GlmConfig", "GlmForCausalLM", {"head_dim": 16}),
    "helium": ("HeliumConfig", "HeliumForCausalLM", {"head_dim": 16}),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", {}),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", {}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 16}),
    "opt": ("OPTConfig", "OPTForCausalLM", {"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8}),
    "codegen": (
        "CodeGenConfig",
        "CodeGenForCausalLM",
        {"n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8},
    ),
    # hybrid models: their recurrent layers' config values are in tiny_hybrid.py
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {}),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", {}),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {}),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {}),
}


def build_tokenizer():
    """A byte-level tokenizer: 256 byte tokens, then the special tokens (ids 256..260)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|end|>", pad_token="<|pad|>", bos_token=None, unk_token=None
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_hidden_layers: int | None = None,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    vocab_size: int | None = None,
    **overrides,
) -> Path:
    """Write a randomly initialised (fixed seed) decoder-only model and its tokenizer to `path`.
    `num_hidden_layers`: the architecture's own tiny count (2, or 4 for a 3:1 layer pattern) unless given."""
    import torch
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    config_name, model_name, family = ARCHITECTURES[arch]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    tok = build_tokenizer()
    settings = dict(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    settings.update(family)
    if num_hidden_layers is not None:
        settings["num_hidden_layers"] = num_hidden_layers
    settings.update(overrides)
    settings = {k: settings["vocab_size"] if v == VOCAB else v for k, v in settings.items()}
    config = config_cls(**settings)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def add_sentence_transformers_config(
    path: str | Path,
    pooling: str = "lasttoken",
    normalize: bool = True,
    max_seq_length: int = 2048,
    **st_config,
) -> Path:
    """Make the model folder at `path` a sentence-transformers model too: modules.json naming the
    Transformer, a Pooling module (`pooling`: sentence-transformers' mode name) and optionally Normalize.
    `st_config` goes into config_sentence_transformers.json (e.g. truncate_dim, matryoshka)."""
    import json

    root = Path(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
        (root / "2_Normalize").mkdir(exist_ok=True)
    hidden = json.loads((root / "config.json").read_text())["hidden_size"]
    (root / "1_Pooling").mkdir(exist_ok=True)
    (root / "1_Pooling" / "config.json").write_text(
        json.dumps({"embedding_dimension": hidden, "pooling_mode": pooling, "include_prompt": True})
    )
    (root / "modules.json").write_text(json.dumps(modules))
    (root / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    (root / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return root
