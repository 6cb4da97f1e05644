"""Turns last-token logits into next tokens, row by row settings, one tensor pass for the batch.

Random rows draw their noise from the sequence's own torch.Generator (the exponential-race form of
sampling: argmax(p / E), E ~ Exp(1)), so a seeded request's tokens do not depend on its neighbours.
"""

from __future__ import annotations

import torch

from .sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[tuple | None]]:
    """Return the next token of each row and, where asked, (chosen logprob, top-k ids, top-k logprobs)."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if random_rows:
        tokens[random_rows] = _sample_random(logits[random_rows], [seqs[i] for i in random_rows])
    token_list = tokens.tolist()
    return token_list, _logprobs(logits, seqs, token_list)


def _sample_random(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    temps = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype, device=logits.device)
    logits = logits / temps.unsqueeze(1)
    top_k = [s.params.top_k for s in seqs]
    top_p = [s.params.top_p for s in seqs]
    if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
        logits = _truncate(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.stack([torch.empty(probs.shape[1]).exponential_(generator=s.generator) for s in seqs])
    noise = noise.to(probs.device)  # drawn on the CPU generators, so CUDA and CPU runs agree
    return (probs / noise).argmax(dim=-1)


def _truncate(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask tokens outside each row's top-k and top-p nucleus (always keeping the best token)."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    device = logits.device
    rank = torch.arange(vocab, device=device).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=device).unsqueeze(1)
    drop = rank >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= torch.tensor(top_p, dtype=probs.dtype, device=device).unsqueeze(1)
    drop[:, 0] = False
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, masked)


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[tuple | None]:
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    result: list[tuple | None] = [None] * len(seqs)
    if not wanted:
        return result
    logp = torch.log_softmax(logits[wanted], dim=-1)
    max_k = max(seqs[i].params.logprobs for i in wanted)
    top_vals, top_ids = logp.topk(max_k, dim=-1) if max_k else (None, None)
    for row, i in enumerate(wanted):
        k = seqs[i].params.logprobs
        chosen = float(logp[row, tokens[i]])
        ids = top_ids[row, :k].tolist() if k else []
        vals = top_vals[row, :k].tolist() if k else []
        result[i] = (chosen, ids, vals)
    return result
