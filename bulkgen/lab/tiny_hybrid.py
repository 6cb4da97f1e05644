"""Tiny, deterministic random-weight hybrid models (linear attention, Mamba-2 or short-conv layers beside
full attention), built from transformers' config classes: the engine's hybrid-model test fixtures.

Each has hidden size 64 and three layers, one of them full attention (Falcon-H1 runs attention and
Mamba side by side in every layer), so a test covers state slots and the paged cache in one forward.
"""

from __future__ import annotations

from pathlib import Path

from .tiny import build_tokenizer

_LINEAR = dict(
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
)
_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
)
_MAMBA = dict(
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16
)

# name -> (config class, causal LM class, config values beyond the shared ones)
HYBRID_ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {**_LINEAR, **_MOE, "decoder_sparse_step": 1}),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _LINEAR),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**_LINEAR, **_MOE}),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        {
            **_MAMBA,
            "mamba_expand": 1,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
            "layer_types": ["mamba", "attention", "mamba"],
        },
    ),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {**_MAMBA, "mamba_d_ssm": 64, "head_dim": 16}),
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {"conv_L_cache": 3, "layer_types": ["conv", "full_attention", "conv"]},
    ),
}


def build_tiny_hybrid(
    path: str | Path,
    arch: str,
    *,
    seed: int = 0,
    max_position_embeddings: int = 2048,
    initializer_range: float = 0.1,
) -> Path:
    """Write a randomly initialised (fixed seed) tiny hybrid model of `arch` and its tokenizer to `path`.
    Weights are drawn wider than transformers' default (0.02), so each layer, and so each sequence's
    state, moves the greedy tokens: a state carried wrongly across chunks changes them."""
    import torch
    import transformers

    if arch not in HYBRID_ARCHITECTURES:
        raise ValueError(
            f"unknown tiny hybrid architecture {arch!r}; choose one of {sorted(HYBRID_ARCHITECTURES)}"
        )
    config_name, model_name, extra = HYBRID_ARCHITECTURES[arch]
    tok = build_tokenizer()
    config = getattr(transformers, config_name)(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
