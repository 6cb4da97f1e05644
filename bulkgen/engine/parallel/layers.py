"""Parallel layer types: how one module of a tensor-parallel model splits. A plan (sharding.tp_plan) names a
style per module or parameter, as transformers' plans do; STYLES maps each style name (transformers' and
bulkgen's own) to the one object that owns, for that split:

- `read`: the slice of a checkpoint tensor (weight, bias) a rank holds. An FP8 checkpoint's tensor is read
  through shard_quantized.Fp8Slice, which slices its scales with the same index, so the scales follow;
- `install`: what runs after its module's forward (a row-parallel layer's and the fused experts' partial
  sums all-reduced; the vocabulary-parallel modules reduce and gather inside their own forward);
- `shard_lora`: how a LoRA adapter's A and B split on it (lora_tp.py), and `lora_reduces`: whether the
  adapter's shrink is a partial sum to all-reduce.

A style with parameters ("colwise_parts:32,32,64", "packed_qkv:64,16") builds its type from them
(parallel_layer). Which module takes which style per family stays data: the plans in sharding.py and
shard_*.py.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from bulkgen.engine.model.quantize import Fp8Linear
from bulkgen.engine.parallel.shard_base import style_of


def shard_slice(full: tuple[int, ...], local: tuple[int, ...], rank: int, world: int) -> tuple | None:
    """Index of this rank's part of a checkpoint tensor of shape `full` for a parameter of shape `local`
    (None: the whole tensor): the one dimension where they differ is the split one."""
    if full == local:
        return None
    dim = next(d for d in range(len(full)) if full[d] != local[d])
    chunks = full[dim] // local[dim]
    index = rank * chunks // world  # KV heads fewer than ranks: neighbours share one
    return (slice(None),) * dim + (slice(index * local[dim], (index + 1) * local[dim]),)


class ParallelLayer:
    """A module whose tensors are whole on every rank unless the rank's model built them smaller, then
    split along the one dimension that differs (shard_slice); nothing runs after its forward, a LoRA
    adapter on it is whole. transformers' `replicated_with_grad_allreduce`."""

    lora_reduces = False  # a LoRA adapter's shrink on it is a partial sum (RowParallel)
    splits_input = False  # it sees a slice of its input's width (shard_quantized's activation scales)

    def read(
        self, view, full: tuple[int, ...], shape: tuple[int, ...], rank: int, world: int
    ) -> torch.Tensor:
        """This rank's part of one checkpoint tensor (`view`: a safetensors slice or a tensor) of shape
        `full` for a parameter of shape `shape`."""
        index = shard_slice(full, shape, rank, world)
        return view[index] if index is not None else view[:]

    def unpacked(self) -> ParallelLayer:
        """The type of one part of this layer stored alone in the checkpoint (a legacy expert's gate or up
        tensor, filling half of a packed gate_up)."""
        return self

    def added_once(self, leaf: str) -> bool:
        """Whether parameter `leaf` of the module is added by rank 0 alone (zero on the others): a bias
        before an all-reduce would count world times."""
        return False

    def install(self, module: nn.Module, group) -> bool:
        """Register what runs after `module`'s forward; whether it all-reduces the module's output."""
        return False

    def shard_lora(
        self, target: nn.Linear, a: torch.Tensor, b: torch.Tensor, rank: int, world: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s (A, B) of an adapter on `target` (the rank's linear), unchanged where its shapes
        do not split as the base weight does (lora._checked then names the mismatch)."""
        return a, b


class Unplanned(ParallelLayer):
    """A module the plan does not name: whole on every rank; a shape that differs on a rank is refused."""

    def read(self, view, full, shape, rank, world):
        if shard_slice(full, shape, rank, world) is not None:
            raise ValueError(
                f"shape {full} -> {shape} differs on a rank but its module is not in the tensor-parallel plan"
            )
        return view[:]


class ColumnParallel(ParallelLayer):
    """Split by output rows (q/k/v, gate/up; KV heads fewer than ranks: the replicated head's rows). A LoRA
    adapter's A is whole and its B split like the base weight; each rank adds its own rows' delta."""

    def shard_lora(self, target, a, b, rank, world):
        out, width = target.out_features, b.shape[0]
        if width != out and width % out == 0:
            b = b[shard_slice((width, b.shape[1]), (out, b.shape[1]), rank, world)]
        return a, b


class RowParallel(ParallelLayer):
    """Split by input columns (o_proj, down_proj): each rank's output is a partial sum, all-reduced after
    the forward; its bias is added by rank 0 alone. A LoRA adapter's A splits by columns like the weight,
    its shrink (tokens x rank) is all-reduced, B is whole."""

    lora_reduces = splits_input = True

    def read(self, view, full, shape, rank, world):
        if full == shape and len(full) > 1 and world > 1:
            # its partial sums are all-reduced: a whole weight on every rank would count world times
            raise ValueError(
                f"a row-parallel weight of shape {full} is whole on a rank: the model builds it from a width "
                "that tensor parallel does not split"
            )
        return super().read(view, full, shape, rank, world)

    def added_once(self, leaf):
        return leaf == "bias"

    def install(self, module, group):
        if not isinstance(module, (nn.Linear, Fp8Linear)):
            return False
        module.register_forward_hook(_all_reduce(group))
        return True

    def shard_lora(self, target, a, b, rank, world):
        if a.shape[1] == target.in_features * world:
            a = a[shard_slice(tuple(a.shape), (a.shape[0], target.in_features), rank, world)]
        return a, b


class PackedColumnParallel(ParallelLayer):
    """Two column-parallel halves packed along dimension `dim` (a fused gate_up: rows, -2; Llama 4's experts
    [experts, hidden, 2 x inter], used as `x @ w`: the last, -1): each rank its share of each half, so each
    splits as an unpacked one would. A LoRA adapter's B on a packed linear splits half by half."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def read(self, view, full, shape, rank, world):
        share = full[self.dim] // 2 // world
        lead = (slice(None),) * (len(full) + self.dim)
        starts = [part * full[self.dim] // 2 + rank * share for part in (0, 1)]
        return torch.cat([view[lead + (slice(start, start + share),)] for start in starts], dim=self.dim)

    def unpacked(self):
        return COLUMN

    def shard_lora(self, target, a, b, rank, world):
        out = target.out_features
        if self.dim == -2 and b.shape[0] == out * world and out % 2 == 0:
            b = self.read(b, tuple(b.shape), None, rank, world)
        return a, b


class PackedQKVParallel(ParallelLayer):
    """A packed [q | k | v] projection of unequal parts (Phi-3's qkv_proj): each rank its query heads' rows
    and the rows of the KV heads they read (a KV head replicated as for a separate k_proj), so does a LoRA
    adapter's B. `params`: the rank's query width and the head width, "query,head" (the checkpoint's shape
    alone does not say where q ends)."""

    def __init__(self, params: str) -> None:
        self.query_width, self.head_dim = (int(n) for n in params.split(","))

    def read(self, view, full, shape, rank, world):
        query = self.query_width * world
        kv = (full[0] - query) // 2
        kv_local = max(kv // self.head_dim // world, 1) * self.head_dim
        parts = []
        for start, width, local in (
            (0, query, self.query_width),
            (query, kv, kv_local),
            (query + kv, kv, kv_local),
        ):
            rows = shard_slice((width,), (local,), rank, world)[0] if width != local else slice(0, width)
            parts.append(view[start + rows.start : start + rows.stop])
        return torch.cat(parts, dim=0)

    def shard_lora(self, target, a, b, rank, world):
        if b.shape[0] != target.out_features:
            b = self.read(b, tuple(b.shape), None, rank, world)
        return a, b


class PartsColumnParallel(ParallelLayer):
    """Rows that are consecutive parts of a * world, b * world, ... rows, of which each rank holds its a,
    b, ... (Qwen3.5's in_proj_qkv and conv1d, Granite 4's Mamba in_proj: shard_hybrid.py). `params`: the
    rank's part sizes, "a,b,c" from the rank's model; a part "b~" may instead be held once, whole on every
    rank, when the checkpoint's rows add up only that way."""

    def __init__(self, params: str) -> None:
        self.tokens = params.split(",")

    def read(self, view, full, shape, rank, world):
        shares = [int(token.rstrip("~")) for token in self.tokens]
        copies = [world] * len(shares)
        if sum(shares) * world != full[0]:
            copies = [1 if token.endswith("~") else world for token in self.tokens]
        if sum(n * c for n, c in zip(shares, copies, strict=True)) != full[0]:
            raise ValueError(f"its {full[0]} rows are not parts of {[n * world for n in shares]} rows")
        chunks, start = [], 0
        for rows, count in zip(shares, copies, strict=True):
            offset = start + (rank * rows if count == world else 0)
            chunks.append(view[offset : offset + rows])
            start += rows * count
        return torch.cat(chunks, dim=0)


class FusedExpertsParallel(ParallelLayer):
    """An experts module whose gate_up and down tensors split by the plan's entries for them: its output,
    the routed experts' partial sums, is all-reduced after the forward (unless its MoE block is reduced
    once: shard_families.in_block), and a down-projection bias (gpt-oss') is added by rank 0 alone."""

    def added_once(self, leaf):
        return leaf == "down_proj_bias"

    def install(self, module, group):
        module.register_forward_hook(_all_reduce(group))
        return True


class VocabParallel(ParallelLayer):
    """The embedding and the LM head split by vocabulary rows, padded to a multiple of the world size
    (zero rows after the last shard's): the embedding's lookups are all-reduced and the head's logits
    gathered inside their forward (VocabParallelEmbedding, VocabParallelHead; a head's bias splits like
    its weight). Given to the parameters of those modules, whatever the plan says (sharding._layer)."""

    def read(self, view, full, shape, rank, world):
        rows = shape[0]
        data = view[rank * rows : min((rank + 1) * rows, full[0])]
        if data.shape[0] == rows:
            return data
        return torch.cat([data, data.new_zeros((rows - data.shape[0], *data.shape[1:]))])

    def split(self, model: nn.Module, config, group) -> None:
        """Vocabulary-parallel embedding and head where they are plain modules (a scaled embedding stays
        whole)."""
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        if type(embed) is nn.Embedding:
            model.set_input_embeddings(VocabParallelEmbedding(config.vocab_size, embed.embedding_dim, group))
        if type(head) is nn.Linear:
            new = VocabParallelHead(config.vocab_size, head.in_features, group, head.bias is not None)
            if config.tie_word_embeddings and isinstance(
                model.get_input_embeddings(), VocabParallelEmbedding
            ):
                new.weight = model.get_input_embeddings().weight
            model.set_output_embeddings(new)


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + shard) of the embedding; ids outside them look up zeros, and the ranks'
    lookups are summed."""

    def __init__(self, vocab: int, hidden: int, group) -> None:
        super().__init__()
        self.shard = -(-vocab // group.world)
        self.start, self.group = group.rank * self.shard, group
        self.weight = nn.Parameter(torch.empty(self.shard, hidden, device="meta"), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill(outside[..., None], 0))


class VocabParallelHead(nn.Module):
    """The LM head's rows of this rank's vocabulary shard; every rank gets the gathered full logits."""

    def __init__(self, vocab: int, hidden: int, group, bias: bool) -> None:
        super().__init__()
        self.vocab_size, self.group = vocab, group
        shard = -(-vocab // group.world)
        self.weight = nn.Parameter(torch.empty(shard, hidden, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(shard, device="meta"), requires_grad=False) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = nn.functional.linear(hidden, self.weight, self.bias)
        return self.group.all_gather(local)[..., : self.vocab_size]


def _all_reduce(group):
    def reduce(_module, _args, output: torch.Tensor) -> torch.Tensor:
        return group.all_reduce(output)

    return reduce


COLUMN, UNPLANNED, VOCAB = ColumnParallel(), Unplanned(), VocabParallel()
# plan style name -> its layer type: transformers' names, then bulkgen's own; a type taking parameters
# (after the style's ":") is its class
STYLES: dict[str, ParallelLayer | type[ParallelLayer]] = {
    "colwise": COLUMN,
    "rowwise": RowParallel(),
    "replicated_with_grad_allreduce": ParallelLayer(),
    "packed_colwise": PackedColumnParallel(dim=-2),  # a fused gate_up: each half's rows
    "packed_rowwise": PackedColumnParallel(dim=-1),  # Llama 4's experts' gate_up: each half's columns
    "moe_tp_experts": FusedExpertsParallel(),
    "packed_qkv": PackedQKVParallel,
    "colwise_parts": PartsColumnParallel,
}


@functools.lru_cache(maxsize=256)
def parallel_layer(style: str | None) -> ParallelLayer:
    """The layer type of a plan style (None: a module the plan does not name); KeyError for a style not
    in STYLES (sharding.tp_plan refuses such a plan first)."""
    if style is None:
        return UNPLANNED
    name, _, params = style.partition(":")
    kind = STYLES[name]
    return kind(params) if isinstance(kind, type) else kind


def layer_of(plan: dict[str, str], name: str) -> ParallelLayer:
    """The layer type of module or parameter `name` in `plan`."""
    return parallel_layer(style_of(plan, name))
