"""Tiny, deterministic random-weight hybrid models (linear attention, Mamba-2 or short-conv layers beside
full attention), built from transformers' config classes: the engine's hybrid-model test fixtures.

Each has hidden size 64 and three layers, one of them full attention (Falcon-H1 runs attention and
Mamba side by side in every layer), so a test covers state slots and the paged cache in one forward.
"""

from __future__ import annotations

from pathlib import Path

from .tiny import build_tiny_model

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

# name (a tiny.ARCHITECTURES key) -> its config values beyond the shared ones
HYBRID_ARCHITECTURES: dict[str, dict] = {
    "qwen3_next": {**_LINEAR, **_MOE, "decoder_sparse_step": 1},
    "qwen3_5": _LINEAR,
    "qwen3_5_moe": {**_LINEAR, **_MOE},
    "granitemoehybrid": {
        **_MAMBA,
        "mamba_expand": 1,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 64,
        "layer_types": ["mamba", "attention", "mamba"],
    },
    "falcon_h1": {**_MAMBA, "mamba_d_ssm": 64, "head_dim": 16},
    "lfm2": {"conv_L_cache": 3, "layer_types": ["conv", "full_attention", "conv"]},
}


def build_tiny_hybrid(
    path: str | Path, arch: str, *, seed: int = 0, initializer_range: float = 0.1, **overrides
) -> Path:
    """Write a randomly initialised (fixed seed) tiny hybrid model of `arch` and its tokenizer to `path`
    (`overrides`: config values replacing the architecture's, e.g. a head count a test needs).
    Weights are drawn wider than transformers' default (0.02), so each layer, and so each sequence's
    state, moves the greedy tokens: a state carried wrongly across chunks changes them."""
    if arch not in HYBRID_ARCHITECTURES:
        raise ValueError(
            f"unknown tiny hybrid architecture {arch!r}; choose one of {sorted(HYBRID_ARCHITECTURES)}"
        )
    extra = {**HYBRID_ARCHITECTURES[arch], **overrides}
    return build_tiny_model(
        path, arch, seed=seed, num_hidden_layers=3, initializer_range=initializer_range, **extra
    )
