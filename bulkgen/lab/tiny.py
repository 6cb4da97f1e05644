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

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    # hybrid models: their recurrent layers' config values are in tiny_hybrid.py
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM"),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"),
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
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    vocab_size: int | None = None,
    **overrides,
) -> Path:
    """Write a randomly initialised (fixed seed) decoder-only model and its tokenizer to `path`."""
    import torch
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    config_cls, model_cls = (getattr(transformers, n) for n in ARCHITECTURES[arch])
    tok = build_tokenizer()
    config = config_cls(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        **overrides,
    )
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
