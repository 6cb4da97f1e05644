"""Memory of one tensor-parallel rank, from a model's config alone (no weights read): what `bulkgen plan
--tensor-parallel N` prints and what a load checks before a model that cannot fit one GPU is loaded.

Each rank holds its share of every split weight (sharding.local_config: heads and MLP widths / N), the
whole of every replicated one (norms, routers), 1/N of the vocabulary rows of the embedding and the
head, and the KV cache of its KV heads (replicated when there are fewer KV heads than ranks; an MLA
model's latent, one row of kv_lora_rank + rope values per layer, is whole on every rank). A hybrid's
linear-attention layers hold no KV cache but a recurrent state per sequence, of the rank's heads
(shard_hybrid.py)."""

from __future__ import annotations

import torch

from bulkgen.engine.attention.mla import latent_width
from bulkgen.engine.parallel.shard_families import fit_modules
from bulkgen.engine.parallel.shard_hybrid import attention_layers, state_bytes_per_sequence
from bulkgen.engine.parallel.sharding import local_config

GIB = 1 << 30
FIT_SHARE = 0.9  # of a device's free memory the weights may take: the rest is activations and KV cache


def rank_memory(config, world: int, dtype: torch.dtype) -> dict:
    """Bytes one rank of `world` holds: its weights and its KV cache per token; ValueError if the model's
    heads or widths do not split over `world` ranks."""
    from transformers import AutoModelForCausalLM

    local = local_config(config, world)
    with torch.device("meta"):  # no bytes at all: DeepSeek-V3's fused experts are 30 GB a layer in fp32
        model = AutoModelForCausalLM.from_config(local)
        fit_modules(model, config, world)
    size = torch.empty((), dtype=dtype).element_size()
    vocab_params = {  # a head's bias (Phi's) splits by vocabulary like its weight
        id(p): p.numel()
        for m in (model.get_input_embeddings(), model.get_output_embeddings())
        if m is not None
        for p in (m.weight, getattr(m, "bias", None))
        if p is not None
    }
    params = sum(p.numel() for p in model.parameters())
    vocab = sum(vocab_params.values())
    shard_rows = -(-config.vocab_size // world)
    params += vocab * shard_rows // config.vocab_size - vocab
    layers = attention_layers(config)  # a hybrid's recurrent layers hold a state per sequence instead
    latent = latent_width(config)  # MLA caches one latent row per layer, whole on every rank (mla.py)
    kv_per_token = layers * size * (latent or 2 * local.num_key_value_heads * local.head_dim)
    return {
        "ranks": world,
        "weight_bytes": params * size,
        "kv_bytes_per_token": kv_per_token,
        "state_bytes_per_sequence": state_bytes_per_sequence(local, dtype),
    }


def ranks_needed(config, dtype: torch.dtype, free_bytes: int, most: int = 64) -> int | None:
    """The fewest ranks (dividing the model's heads) whose weights each fit FIT_SHARE of `free_bytes`;
    None if no count up to `most` does."""
    for world in range(1, most + 1):
        try:
            weights = rank_memory(config, world, dtype)["weight_bytes"]
        except ValueError:  # heads or widths that do not split over this many ranks
            continue
        if weights <= FIT_SHARE * free_bytes:
            return world
    return None


def check_fits(path: str, config, dtype: torch.dtype, world: int, free_bytes: int, device: str) -> None:
    """ValueError naming the memory and --tensor-parallel when one rank's weights do not fit the device."""
    weights = rank_memory(config, world, dtype)["weight_bytes"]
    if weights <= FIT_SHARE * free_bytes:
        return
    need = ranks_needed(config, dtype, free_bytes)
    advice = (
        f"serve it with --tensor-parallel {need} ({rank_memory(config, need, dtype)['weight_bytes'] / GIB:.1f} "
        "GiB of weights per GPU)"
        if need
        else "no tensor-parallel size up to 64 fits it"
    )
    raise ValueError(
        f"model at {path} needs {weights / GIB:.1f} GiB of {str(dtype).removeprefix('torch.')} weights "
        f"per rank with tensor_parallel={world}, but {device} has {free_bytes / GIB:.1f} GiB free; {advice}"
    )


def check_device_fits(path: str, dtype: torch.dtype, world: int, device: str) -> None:
    """Before loading on a GPU: refuse (check_fits) a model whose rank weights exceed the device's free memory."""
    if not str(device).startswith("cuda"):
        return
    from transformers import AutoConfig

    free, _ = torch.cuda.mem_get_info(torch.device(device))
    check_fits(path, AutoConfig.from_pretrained(path, local_files_only=True), dtype, world, free, str(device))
