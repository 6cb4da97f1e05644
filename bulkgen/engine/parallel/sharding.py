"""Tensor-parallel shards of a transformers model: which weights split along which dimension, and a loader
that reads only this rank's slice of each safetensors tensor.

The model is built from a *local* config (attention heads, KV heads and MLP widths divided by the world
size), so every transformers module already has its shard's shape and its forward works unchanged:
attention views its projections with `-1` heads, so it runs on the rank's heads, and bulkgen's probe
(layer_attention.py) sizes each rank's KV cache from the heads it sees. Where a row-parallel layer
leaves partial sums (o_proj, down_proj, an MoE block's experts) a forward hook all-reduces them; the
embedding and the LM head are split by vocabulary (padded to a multiple of the world size) and
all-reduced / gathered. KV heads fewer than ranks are replicated, as vLLM does: rank r keeps KV head
r * kv_heads // world, the one its query heads read.

Which module splits how comes from the model's own transformers plan (`base_model_tp_plan`) where it has
one, else from DEFAULT_PLAN (the Llama names most decoder families share); shard_families.py adds what some
families' plans leave out (shared experts, MoE blocks reduced once, modules sized from the hidden width).

Online FP8 (`quantize="fp8"`, quantize.py) quantizes each rank's shard after it is read, on the host, as
its layers move to the device. A column-parallel shard holds whole output rows, so its per-channel scales
are exactly the single-process model's; a row-parallel shard (o_proj, down_proj, experts' down) holds a
slice of each row and gets its own scales from that slice, as do its per-token activation scales: each
rank's partial sum is quantized at least as finely as the whole row would be, and the result is close to,
not equal to, the single-process FP8 model's (tests/engine/test_tensor_parallel_fp8.py measures it).
"""

from __future__ import annotations

import re
from copy import deepcopy
from pathlib import Path

import torch
from torch import nn

from bulkgen.engine.features.hybrid_layers import find_mixers
from bulkgen.engine.model.quantize import quantize_layers
from bulkgen.engine.parallel import shard_families as families
from bulkgen.engine.parallel import shard_hybrid as hybrid
from bulkgen.engine.parallel.layers import (
    STYLES,
    VOCAB,
    ParallelLayer,
    VocabParallelEmbedding,
    VocabParallelHead,
    layer_of,
    parallel_layer,
)
from bulkgen.engine.parallel.shard_base import materialize, parameters_on_meta, safetensors_files, style_of
from bulkgen.engine.parallel.shard_gptoss import family_plan, load_mxfp4_experts
from bulkgen.engine.parallel.shard_mla import mla_plan
from bulkgen.engine.parallel.shard_packed import covered_plan, whole_width_norms
from bulkgen.engine.parallel.shard_quantized import fp8_checkpoint

DEFAULT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
# config fields that are per-rank widths: each is divided by the world size
SPLIT_FIELDS = (
    "num_attention_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "intermediate_size_mlp",  # Llama 4's dense layers'
    *hybrid.LINEAR_HEAD_FIELDS,
)
_EXPERT = re.compile(rf"^(.*\.experts)\.(\d+)\.({'|'.join(families.EXPERT_NAMES)})\.weight$")


def local_config(config, world: int):
    """A copy of `config` with this rank's share of heads and widths; ValueError naming a field that
    does not split over `world` ranks."""
    local = deepcopy(config)
    heads = config.num_attention_heads
    local.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    for name in SPLIT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value:
            if value % world:
                raise ValueError(f"tensor_parallel={world} does not divide the model's {name} ({value})")
            setattr(local, name, value // world)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if kv % world and world % kv:
        raise ValueError(
            f"tensor_parallel={world} neither divides nor is a multiple of num_key_value_heads ({kv})"
        )
    local.num_key_value_heads = max(kv // world, 1)
    hybrid.split_mamba(local, config, world)
    if any(getattr(config, "activation_sparsity_pattern", None) or ()):
        raise ValueError(
            f"tensor_parallel={world}: this model's MLP keeps its top activations by their mean and spread over "
            "the whole width (activation_sparsity_pattern), which a rank's slice of the width does not have"
        )
    return local


def check_splittable(config, world: int) -> None:
    """ValueError, before any rank starts, for a checkpoint the ranks cannot split: heads or widths that
    do not divide (local_config), or quantized weights other than FP8 (shard_quantized.py) and gpt-oss'
    MXFP4 (shard_gptoss.py)."""
    local_config(config.get_text_config(), world)
    hybrid.check_recurrent_split(config.get_text_config(), world)
    fp8_checkpoint(config, world)


def tp_plan(model: nn.Module) -> dict[str, str]:
    """Module or parameter path patterns (from the model's root, `*` for a layer index) -> style. A
    vision-language model's is its language model's plan, at that model's path (the encoder stays whole)."""
    config, prefix = model.config, families.base_prefix(model)
    if getattr(config, "vision_config", None) is not None:
        decoder = model.get_decoder()
        config = decoder.config
        prefix = next(name for name, module in model.named_modules() if module is decoder)
    base = family_plan(config) or families.family_plan(
        config.model_type, getattr(config, "base_model_tp_plan", None) or DEFAULT_PLAN
    )
    base = {**families.fused_experts_plan(model, prefix), **base}
    base = {**base, **hybrid.linear_attention_plan(config), **hybrid.mamba_plan(config)}
    base = mla_plan(model, base)
    if (
        prefix != model.base_model_prefix
    ):  # a language model whose plan names only its embedding (Qwen3-VL's),
        # which VocabParallel splits anyway: its layers take the common names' plan
        base = {k: v for k, v in base.items() if v not in families.DROPPED} or DEFAULT_PLAN
    plan = {f"{prefix}.{key}" if prefix else key: style for key, style in base.items()}
    plan = covered_plan(model, config, plan)  # whole-width q/k norms, packed qkv and gate_up
    unsupported = sorted({s for s in plan.values() if s.partition(":")[0] not in STYLES})
    if unsupported:
        raise ValueError(
            f"{type(model).__name__}'s tensor-parallel plan uses {unsupported}; bulkgen shards {sorted(STYLES)}"
        )
    return plan


def build_shard_model(path: str | Path, group, dtype: torch.dtype, quantize: str | None = None) -> nn.Module:
    """Rank `group.rank`'s model of a decoder-only checkpoint (group: tensor_parallel.RankGroup, which the
    parallel layers and hooks take as they are built and tensor_parallel.load_shard hands on beside the
    model; a vision-language checkpoint is vision_shards.build_vision_shard's, and load_shard picks): built with no parameter memory, then filled from its slices of the
    checkpoint; `quantize`: its decoder layers' linears quantized a layer at a time as they move to the
    device (quantize.quantize_layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(local_config(config, group.world), dtype=dtype)
        families.fit_modules(model, config, group.world)
    hybrid.check_split_mixers(model, find_mixers(model))  # before any weight is read
    model.config._name_or_path = str(path)  # the engine reads the model's folder (pooling config)
    if (Path(path) / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    plan = tp_plan(model)
    VOCAB.split(model, config, group)
    load_mxfp4_experts(model, path, group.rank, dtype, "cpu" if quantize else group.device)
    if fp8 := fp8_checkpoint(config, group.world, group.device):  # as loading.load_model: its own format
        quantize = "fp8" if fp8.keeps_fp8 else None
    load_shards(model, path, plan, group.rank, group.world, dtype, "cpu" if quantize else group.device)
    whole_width_norms(model, plan, config, group)
    hybrid.share_group_norm(model, config, group)
    if quantize:
        quantize_layers(model, group.device, quantize)
    elif fp8:
        fp8.attach_activations(model, path, plan, group)
    add_all_reduces(model, plan, group)  # on the modules the model runs: quantized ones replaced the float
    return model.to(group.device).eval()


def add_all_reduces(model: nn.Module, plan: dict[str, str], group) -> None:
    """Sum the partial outputs of row-parallel linears and of tensor-parallel experts across ranks (each
    module's layer type installs its all-reduce: layers.py), an MoE block's once at its output."""
    blocks = families.reduce_blocks(model, group)
    reduced = {i for name in blocks for i in re.findall(r"\.(\d+)\.", name + ".")[:1]}
    for name, module in model.named_modules():
        if families.in_block(model, name):
            continue
        if layer_of(plan, name).install(module, group):
            reduced.update(re.findall(r"\.(\d+)\.", name)[:1])
    layers = model.config.get_text_config().num_hidden_layers
    missing = sorted(set(range(layers)) - {int(i) for i in reduced})
    if missing:
        # such a layer runs whole on every rank, but from the local config's head count: its attention
        # would split its projections into wrongly sized heads (OPT's q_proj is hidden x hidden whatever
        # the heads) and give other tokens with no error
        raise ValueError(
            f"{type(model).__name__}: the tensor-parallel plan splits nothing in layers {missing[:4]} "
            f"(its names: {sorted(plan)[:3]}...); bulkgen cannot shard this model's layers"
        )


def _read(view, layer: ParallelLayer, shape: tuple[int, ...], rank: int, world: int, half: int | None):
    """This rank's slice of one checkpoint tensor (`view`: a safetensors slice) for a parameter of shape
    `shape` split as `layer`; for a legacy expert, `half` says which half of the packed gate_up it fills."""
    full = tuple(view.get_shape())
    if half is not None:
        shape, layer = (shape[-2] // 2, shape[-1]), layer.unpacked()
    elif len(full) < len(shape):  # a legacy expert's down_proj, into the fused [experts, out, in]
        shape = shape[1:]
    return layer.read(view, full, shape, rank, world)


def _layer(plan: dict[str, str], name: str, vocab: set[str]) -> ParallelLayer:
    """How parameter `name` splits: its own plan entry's layer type, its module's, or VOCAB (`vocab`: the
    names of the vocabulary-split embedding's and head's parameters)."""
    if name in vocab:
        return VOCAB
    module, _, leaf = name.rpartition(".")
    style = (
        style_of(plan, name) or style_of(plan, module) if leaf in ("weight", "bias") else style_of(plan, name)
    )
    return parallel_layer(style)


def load_shards(model: nn.Module, path, plan: dict[str, str], rank: int, world: int, dtype, device) -> None:
    """Fill every parameter from the safetensors files with this rank's slice only; ValueError naming a
    parameter the checkpoint lacks. Peak memory: the rank's parameters plus one slice. The checkpoint is
    checked first as the single engine's load checks it (checkpoint_checks.py: its headers, every
    quantized tensor's scale, every scale finite): CheckpointError naming the file and tensor."""
    from safetensors import safe_open

    from bulkgen.engine.model.checkpoint_checks import check_checkpoint

    quant = getattr(model.config, "quantization_config", None)
    check_checkpoint(path, quant.to_dict() if hasattr(quant, "to_dict") else quant)

    params = dict(model.named_parameters(remove_duplicate=False))
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    split = {  # a head's bias (Phi's) splits by vocabulary like its weight
        id(p)
        for m in (embed, head)
        if isinstance(m, (VocabParallelEmbedding, VocabParallelHead))
        for p in (m.weight, getattr(m, "bias", None))
        if p is not None
    }
    # by name, taken while every parameter is alive: a parameter materialized later can reuse the id of a
    # freed meta one, and an expert's weight was once read as a vocabulary shard that way
    vocab = {name for name, p in params.items() if id(p) in split}
    filled: set[str] = set()
    rename = _renamer(model)
    fp8 = fp8_checkpoint(model.config, world)
    for file in safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            handle = fp8.reader(handle, dtype, path) if fp8 else handle
            for name in handle.keys():
                target, half, expert = _target(rename(name, params), params, rename)
                if target is None:
                    continue
                layer = _layer(plan, target, vocab)
                param = materialize(model, target, params, dtype, device)
                owner, _, leaf = target.rpartition(".")
                if rank and layer_of(plan, owner).added_once(leaf):
                    param.data.zero_()  # a bias added once, by rank 0, before its module's all-reduce
                else:
                    try:
                        data = _read(handle.get_slice(name), layer, tuple(param.shape), rank, world, half)
                    except ValueError as err:
                        raise ValueError(f"checkpoint tensor {name}: {err}") from None
                    _place(param, data, half, expert, name)
                filled.add(target)
    missing = sorted(n for n, p in params.items() if n not in filled and p.is_meta)
    if missing:
        raise ValueError(f"checkpoint at {path} has no weights for {missing[:5]}")


def _renamer(model: nn.Module):
    """name, params -> the model's name for a checkpoint tensor: itself where the model has it, else as
    transformers' own renaming rules for the model map it (a vision-language checkpoint saved in an older
    layout: `language_model.model.layers.0...` for `model.language_model.layers.0...`). The rules are
    applied in order, once without and once with their prefix changes (which some layouts' names only
    reach without them), the first name the model has winning."""
    from transformers.conversion_mapping import PrefixChange, WeightRenaming, get_model_conversion_mapping

    chains = [[], []]
    for rule in get_model_conversion_mapping(model):
        if isinstance(rule, WeightRenaming):  # PrefixChange is one too
            targets = rule.target_patterns * len(rule.source_patterns)
            for source, target in zip(rule.source_patterns, targets, strict=False):
                if not isinstance(rule, PrefixChange):
                    chains[0].append((re.compile(source), target))
                chains[1].append((re.compile(source), target))

    def rename(name: str, params: dict) -> str:
        for chain in chains if name not in params else ():
            renamed = name
            for pattern, target in chain:
                renamed = pattern.sub(target, renamed)
            if renamed in params:
                return renamed
        return name

    return rename


def _target(name: str, params: dict, rename) -> tuple[str | None, int | None, int | None]:
    """The model parameter a checkpoint tensor fills: (name, packed half, expert index); a legacy expert's
    fused parameter renamed as the model's rules rename its block (Mixtral's block_sparse_moe -> mlp)."""
    if name in params:
        return name, None, None
    match = _EXPERT.match(name)
    if match:
        fused, half = families.EXPERT_NAMES[match[3]]
        target = rename(f"{match[1]}.{fused}", params)
        if target in params:
            return target, half, int(match[2])
    return None, None, None


def _place(param: torch.Tensor, data: torch.Tensor, half: int | None, expert: int | None, name: str) -> None:
    """Copy a slice into its parameter (one expert's, one half of a packed gate_up)."""
    dest = param.data if expert is None else param.data[expert]
    if half is not None:
        rows = dest.shape[0] // 2
        dest = dest[half * rows : (half + 1) * rows]
    if dest.shape != data.shape:
        raise ValueError(
            f"checkpoint tensor {name}: slice of shape {tuple(data.shape)} does not fit {tuple(dest.shape)}"
        )
    dest.copy_(data)
