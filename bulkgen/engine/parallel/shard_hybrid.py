"""Tensor-parallel split of hybrid models' recurrent layers, as vLLM splits them: the gated delta net
layers of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (each rank holds whole key heads and the value heads that
read them) and Granite 4's Mamba-2 layers (whole heads and whole B/C groups, or a single group whole on
every rank: split_mamba, mamba_plan, share_group_norm).

The local config (sharding.local_config) divides `linear_num_key_heads` and `linear_num_value_heads` by
the world size, so every module of a rank's layer is built at its heads' width and transformers' forward
runs unchanged; the state slots (hybrid_layers.probe_states) are sized from that module, so each rank's
conv and recurrent states hold its heads only. What this module adds is where a rank's rows sit in the
checkpoint:

- Qwen3-Next's `in_proj_qkvz` and `in_proj_ba` are packed per key-head group ([q, k, v, z] and [b, a]
  of the group's value heads, group after group), so a rank's groups are one contiguous block of rows:
  plain colwise.
- Qwen3.5's `in_proj_qkv` and every layer's depthwise `conv1d` hold all queries, then all keys, then all
  values: a rank takes its share of each of the three parts (`colwise_parts`: layers.PartsColumnParallel).
- `in_proj_z`, `in_proj_b`, `in_proj_a`, `A_log` and `dt_bias` are per value head, contiguous: colwise.
- The gated RMSNorm normalizes each head over its own head_dim: replicated, no cross-rank statistic.
- `out_proj` reads the value heads: rowwise, its partial sums all-reduced (sharding.add_all_reduces).

transformers' own plan (`colwise_gather_output` for these projections) gathers every head onto every
rank, which would run the recurrence whole on each one. Other hybrids (Falcon-H1, LFM2, ...) are refused
before any rank starts (check_recurrent_split), and a sharded model whose recurrent module is not one of
SPLIT_MIXERS at the runner (check_split_mixers).
"""

from __future__ import annotations

import functools

import torch

# config fields counting linear-attention heads: split over the ranks like num_attention_heads
LINEAR_HEAD_FIELDS = ("linear_num_key_heads", "linear_num_value_heads")
# the text configs whose gated delta net layout this module knows (a vision-language model's decoder too)
GATED_DELTA_NET_TYPES = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})
MAMBA_TYPE = "granitemoehybrid"  # Granite 4: Mamba-2 layers (split_mamba, mamba_plan)


def linear_attention_plan(config) -> dict[str, str]:
    """Plan entries (from the decoder's root) for a gated delta net model's linear-attention layers,
    replacing transformers' gather-output ones; {} for any other model. `config`: a rank's local one."""
    if getattr(config, "model_type", None) not in GATED_DELTA_NET_TYPES:
        return {}
    keys = config.linear_num_key_heads * config.linear_key_head_dim
    values = config.linear_num_value_heads * config.linear_value_head_dim
    qkv = f"colwise_parts:{keys},{keys},{values}"  # layers.PartsColumnParallel
    layer = "layers.*.linear_attn"
    plan = {f"{layer}.{name}": "colwise" for name in ("in_proj_qkvz", "in_proj_ba", "in_proj_z")}
    plan.update({f"{layer}.{name}": "colwise" for name in ("in_proj_b", "in_proj_a", "A_log", "dt_bias")})
    plan.update({f"{layer}.in_proj_qkv": qkv, f"{layer}.conv1d": qkv, f"{layer}.out_proj": "rowwise"})
    return plan


# config fields only recurrent layers have (Mamba-2, short conv, linear attention), and the layer kinds
# that hold a KV cache: anything else in layer_types is a recurrent layer
_RECURRENT_FIELDS = (
    "mamba_n_heads",
    "mamba_d_state",
    "ssm_state_size",
    "conv_L_cache",
    "linear_num_key_heads",
)
_ATTENTION_KINDS = {"attention", "full_attention", "sliding_attention", "chunked_attention"}


def check_recurrent_split(config, world: int) -> None:
    """ValueError, before any rank starts, for a hybrid whose recurrent layers tensor parallel does not
    split: each rank would run them whole from the local config's head counts and give other tokens."""
    if getattr(config, "model_type", None) in GATED_DELTA_NET_TYPES | {MAMBA_TYPE}:
        return
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - _ATTENTION_KINDS)
    fields = [name for name in _RECURRENT_FIELDS if getattr(config, name, None) is not None]
    if kinds or fields:
        raise ValueError(
            f"tensor_parallel={world}: this {config.model_type} model has recurrent layers "
            f"({', '.join(kinds + fields)}) that tensor parallel does not split (it splits those of "
            f"{sorted(GATED_DELTA_NET_TYPES | {MAMBA_TYPE})}); serve it at tensor_parallel 1"
        )


def split_mamba(local, config, world: int) -> None:
    """Granite 4's Mamba-2 layers on a rank: its share of the heads and of the B/C groups (whole groups,
    so the gated RMSNorm's per-group statistic stays on one rank; one group is whole on every rank, its
    statistic summed over the ranks: share_group_norm), and of the shared MLP's width. The layer sizes
    its inner width as mamba_expand x hidden_size, so the rank's expand is a fraction."""
    if getattr(config, "model_type", None) != MAMBA_TYPE:
        return
    for name in ("mamba_n_heads", "mamba_n_groups", "shared_intermediate_size"):
        value = getattr(config, name)
        if name == "mamba_n_groups" and value == 1:
            continue
        if value % world:
            raise ValueError(f"tensor_parallel={world} does not divide the model's {name} ({value})")
        setattr(local, name, value // world)
    # a float expand: the config's field is typed int (its setter validates it), the layer reads it as a factor
    object.__setattr__(local, "mamba_expand", config.mamba_expand / world)
    inner = config.mamba_n_heads * config.mamba_d_head
    if int(local.mamba_expand * config.hidden_size) != inner // world:  # the layer's int() of the product
        raise ValueError(f"tensor_parallel={world}: a rank's Mamba width is not {inner // world}")


def mamba_plan(config) -> dict[str, str]:
    """Plan entries (from the decoder's root) for Granite 4, whose transformers plan names only the
    experts: attention and shared MLP as Llama's, and the Mamba-2 mixer's heads and groups. `in_proj`
    rows are z, x (per head), B, C (per group), dt (per head); `conv1d`'s channels are x, B, C."""
    if getattr(config, "model_type", None) != MAMBA_TYPE:
        return {}
    inner = int(config.mamba_expand * config.hidden_size)
    groups = config.mamba_n_groups * config.mamba_d_state
    mamba, attn = "layers.*.mamba", "layers.*.self_attn"
    plan = {f"{attn}.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")}
    plan.update({f"{attn}.o_proj": "rowwise", "layers.*.shared_mlp.input_linear": "packed_colwise"})
    plan.update({"layers.*.shared_mlp.output_linear": "rowwise", f"{mamba}.out_proj": "rowwise"})
    plan.update({f"{mamba}.{name}": "colwise" for name in ("A_log", "D", "dt_bias", "norm")})
    # "~": a B/C part, whole on every rank when the checkpoint holds one group (PartsColumnParallel tells)
    plan[f"{mamba}.in_proj"] = f"colwise_parts:{inner},{inner},{groups}~,{groups}~,{config.mamba_n_heads}"
    plan[f"{mamba}.conv1d"] = f"colwise_parts:{inner},{groups}~,{groups}~"
    return plan


def share_group_norm(model: torch.nn.Module, config, group) -> None:
    """Granite 4 with one B/C group over several ranks: the gated RMSNorm's group is the whole inner
    width, which each rank holds a slice of, so its mean square is summed over the ranks (as vLLM's
    Mixer2RMSNormGated does); otherwise each rank's groups are whole and the norm runs as it is."""
    if getattr(config, "model_type", None) != MAMBA_TYPE or config.mamba_n_groups != 1 or group.world == 1:
        return
    width = int(config.mamba_expand * config.hidden_size)
    for layer in model.get_decoder().layers:
        if getattr(layer, "mamba", None) is not None:
            layer.mamba.norm.forward = functools.partial(_group_norm, layer.mamba.norm, group, width)


def _group_norm(norm, group, width: int, hidden_states: torch.Tensor, gate=None) -> torch.Tensor:
    """transformers' GraniteMoeHybridRMSNormGated over one group spread across the ranks."""
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    if gate is not None:
        x = x * torch.nn.functional.silu(gate.to(torch.float32))
    variance = group.all_reduce(x.pow(2).sum(-1, keepdim=True)) / width
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon)).to(dtype)


def state_bytes_per_sequence(local, dtype: torch.dtype) -> int:
    """One sequence's recurrent state on a rank whose model is built from `local` (its heads): per
    recurrent layer, the conv state (kernel-size columns of its channels, in the model's dtype) and the
    recurrent one (float32, as transformers keeps it: hybrid_layers.probe_states finds the same shapes).
    0 for a model without layers this module splits."""
    kind = getattr(local, "model_type", None)
    if kind in GATED_DELTA_NET_TYPES:
        keys, values = local.linear_num_key_heads * local.linear_key_head_dim, local.linear_num_value_heads
        channels, kernel = 2 * keys + values * local.linear_value_head_dim, local.linear_conv_kernel_dim
        recurrent = values * local.linear_key_head_dim * local.linear_value_head_dim
    elif kind == MAMBA_TYPE:
        inner = int(local.mamba_expand * local.hidden_size)
        channels, kernel = inner + 2 * local.mamba_n_groups * local.mamba_d_state, local.mamba_d_conv
        recurrent = local.mamba_n_heads * local.mamba_d_head * local.mamba_d_state
    else:
        return 0
    conv = channels * kernel * torch.empty((), dtype=dtype).element_size()
    layers = sum(kind == "linear_attention" for kind in local.layer_types)
    return layers * (conv + recurrent * 4)


def attention_layers(config) -> int:
    """How many decoder layers hold a KV cache: a hybrid's full-attention ones, else all of them."""
    kinds = getattr(config, "layer_types", None)
    if getattr(config, "model_type", None) not in GATED_DELTA_NET_TYPES | {MAMBA_TYPE} or not kinds:
        return config.num_hidden_layers
    return sum(kind == "full_attention" for kind in kinds)


# the recurrent mixers whose heads this module splits (the rest would run whole on each rank, from the
# local config's head counts, and give other tokens)
SPLIT_MIXERS = frozenset(
    {
        "Qwen3NextGatedDeltaNet",
        "Qwen3_5GatedDeltaNet",
        "Qwen3_5MoeGatedDeltaNet",
        "GraniteMoeHybridMambaLayer",
    }
)


def check_split_mixers(model: torch.nn.Module, mixers: dict[int, torch.nn.Module]) -> None:
    """ValueError naming a sharded model's recurrent layers that tensor parallel does not split."""
    whole = sorted({type(mixer).__name__ for mixer in mixers.values()} - SPLIT_MIXERS)
    if whole:
        raise ValueError(
            f"{type(model).__name__}: tensor parallel does not split the recurrent layers {whole}; "
            f"it splits {sorted(SPLIT_MIXERS)}: serve this model at tensor_parallel 1"
        )
