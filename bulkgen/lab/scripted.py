"""A tiny model that writes a designed text exactly: test fixtures for output parsing (reasoning, tool calls).

The model is an OPT whose next token depends only on the position: token embeddings are zero, each learned
position embedding is a unit vector of its own (position p -> e_p), attention and MLP add nothing (out_proj
and fc2 zero), and the lm_head maps position p to the token scripted there with a large logit. So whatever the
prompt says, greedy decoding (and sampling, the logit margin is hundreds) writes the script.

Position-only means the output depends on where the answer starts: a script is keyed by the prompt length it
follows (`scripts: {prompt_len: text}`), and the position p = prompt_len - 1 + k predicts its k-th token.
Several scripts share one model when their position ranges do not overlap, so a test picks a script by its
prompt's length (e.g. a different question, or `enable_thinking: false`, which lengthens Qwen3's prompt).

The tokenizer is byte-level (any text round-trips) plus a family's marker tokens with their real status:
special ones (dropped by `skip_special_tokens=True` decoding) and added non-special ones (kept), as each
family's real tokenizer has them (FAMILIES). Nothing here touches a model hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LOGIT = 10.0  # the scripted token's weight: its logit is about LOGIT * sqrt(hidden) after the final LayerNorm


@dataclass(frozen=True)
class Family:
    """A model family's marker tokens as its real tokenizer has them."""

    special: tuple[str, ...]  # special tokens (dropped when decoding skips special tokens)
    added: tuple[str, ...]  # added, non-special tokens (kept in decoded text)
    eos: tuple[str, ...]  # tokens that end generation (config eos_token_id); the first is the tokenizer's
    bos: str | None = None


DEEPSEEK_V3 = Family(
    special=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    added=(
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁outputs▁begin｜>",
        "<｜tool▁outputs▁end｜>",
        "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>",
    ),
    eos=("<｜end▁of▁sentence｜>",),
    bos="<｜begin▁of▁sentence｜>",
)

FAMILIES = {
    "qwen3": Family(
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        added=("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
        eos=("<|im_end|>", "<|endoftext|>"),
    ),
    "deepseek_r1": Family(
        special=("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
        added=("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
        eos=("<｜end▁of▁sentence｜>",),
        bos="<｜begin▁of▁sentence｜>",
    ),
    "gpt_oss": Family(
        special=(
            "<|endoftext|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|return|>",
            "<|call|>",
        ),
        added=(),
        eos=("<|return|>", "<|call|>", "<|endoftext|>"),
    ),
    # Kimi K2: its role and tool-call markers are special tokens of its tokenizer (decoding that skips
    # special tokens erases a call's markup); <think> and </think> are text
    "kimi_k2": Family(
        special=(
            "[BOS]",
            "[EOS]",
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|im_system|>",
            "<|im_middle|>",
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
        ),
        added=("<think>", "</think>"),
        eos=("<|im_end|>", "[EOS]"),
    ),
    # GLM-4.5/4.6: role tokens special; its reasoning and call tags as text tokens; generation ends at
    # <|endoftext|>, <|user|> or <|observation|> (its generation_config)
    "glm45": Family(
        special=(
            "[gMASK]",
            "<sop>",
            "<|endoftext|>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
        ),
        added=(
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
        ),
        eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
    ),
    # DeepSeek-V3 / V3.1: sentence markers special; roles, <think> and the tool-call tokens added as text
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v31": DEEPSEEK_V3,
    # Llama 4: its headers, end-of-turn and python markers special
    "llama4": Family(
        special=(
            "<|begin_of_text|>",
            "<|header_start|>",
            "<|header_end|>",
            "<|eot|>",
            "<|eom|>",
            "<|python_start|>",
            "<|python_end|>",
            "<|image|>",
        ),
        added=(),
        eos=("<|eot|>", "<|eom|>"),
        bos="<|begin_of_text|>",
    ),
    # MiniMax-M2: `]~!b[` opens the text, `]~b]` a role, `[e~[` ends a turn (its EOS); its generation prompt
    # opens <think>
    "minimax_m2": Family(
        special=("]~!b[", "]~b]", "[e~["),
        added=("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"),
        eos=("[e~[",),
    ),
}


def build_family_tokenizer(family: Family, template: str):
    """A byte-level tokenizer holding the family's markers (special and not, as the real one) and template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(byte_chars))}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=family.eos[0], bos_token=family.bos, pad_token=family.eos[0]
    )
    tok.chat_template = template
    return tok


def build_scripted_model(
    path: str | Path, family: str | Family, template: str, scripts: dict[int, str], hidden_size: int = 1024
) -> Path:
    """Write a model that, after a prompt of `prompt_len` tokens, writes `scripts[prompt_len]` (encoded by the
    family's tokenizer, markers as single tokens: end the text with an EOS marker to stop there)."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    fam = FAMILIES[family] if isinstance(family, str) else family
    tok = build_family_tokenizer(fam, template)
    eos = [tok.convert_tokens_to_ids(t) for t in fam.eos]
    config = OPTConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        word_embed_proj_dim=hidden_size,
        num_hidden_layers=1,
        ffn_dim=4,
        num_attention_heads=8,
        max_position_embeddings=hidden_size,
        eos_token_id=eos,
        pad_token_id=eos[0],
        bos_token_id=tok.bos_token_id,
        tie_word_embeddings=False,
        enable_bias=True,
        do_layer_norm_before=True,
    )
    model = OPTForCausalLM(config).to(torch.float32).eval()
    decoder = model.model.decoder
    with torch.no_grad():
        decoder.embed_tokens.weight.zero_()
        decoder.embed_positions.weight.zero_()
        offset = decoder.embed_positions.offset  # OPT's learned positions start at row 2
        for p in range(hidden_size):
            decoder.embed_positions.weight[p + offset, p] = 1.0
        for layer in decoder.layers:
            for linear in (layer.self_attn.out_proj, layer.fc2):
                linear.weight.zero_()
                linear.bias.zero_()
        model.lm_head.weight.copy_(_script_head(tok, scripts, hidden_size))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    model.generation_config.eos_token_id = eos
    model.generation_config.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _script_head(tok, scripts: dict[int, str], hidden_size: int):
    import torch

    head = torch.zeros(len(tok), hidden_size)
    taken: dict[int, int] = {}
    for prompt_len, text in scripts.items():
        ids = tok.encode(text, add_special_tokens=False)
        for k, token in enumerate(ids):
            position = prompt_len - 1 + k
            if position >= hidden_size or position in taken:
                raise ValueError(
                    f"script after a {prompt_len}-token prompt reaches position {position}, "
                    + (
                        "past the model's positions"
                        if position >= hidden_size
                        else f"taken by {taken[position]}"
                    )
                )
            taken[position] = prompt_len
            head[token, position] = LOGIT
    return head
