"""The embedding and the LM head split by vocabulary over a tensor-parallel group (sharding.py): each rank
holds rows [start, start + shard) of the vocabulary, padded to a multiple of the world size; lookups are
all-reduced and logits gathered."""

from __future__ import annotations

import torch
from torch import nn


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


def split_vocab(model: nn.Module, config, group) -> None:
    """Vocabulary-parallel embedding and head where they are plain modules (a scaled embedding stays whole)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embed) is nn.Embedding:
        model.set_input_embeddings(VocabParallelEmbedding(config.vocab_size, embed.embedding_dim, group))
    if type(head) is nn.Linear:
        new = VocabParallelHead(config.vocab_size, head.in_features, group, head.bias is not None)
        if config.tie_word_embeddings and isinstance(model.get_input_embeddings(), VocabParallelEmbedding):
            new.weight = model.get_input_embeddings().weight
        model.set_output_embeddings(new)
