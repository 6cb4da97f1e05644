"""Turns last-token logits into next tokens on the logits' device, one tensor pass for the batch.

Greedy rows take the argmax. Random rows sample by inverse CDF: one counter-based uniform per draw
(see counter_rng) against the cumulative sum of exp(logits / T) in vocabulary order. top-k masks
below the k-th weight (ties kept). top-p needs no sort: a drawn token is in the nucleus iff the
mass of strictly heavier tokens is below top_p, so draws are tested and redrawn with the next
counter (each round accepts with probability >= top_p); rows still unaccepted after a few rounds
fall back to an exact sorted nucleus. Everything a row does depends only on its own logits, key and
position, so a seeded request samples the same tokens whatever shares its batch.
"""

from __future__ import annotations

import torch

from .counter_rng import MASK32, uniforms
from .sequence import Sequence

DRAWS_PER_POSITION = 64  # counter = position * 64 + round
REJECTION_ROUNDS = 8


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[tuple | None]]:
    """Return the next token of each row and, where asked, (chosen logprob, top-k ids, top-k logprobs).

    The sampled tokens cross to the host in one copy."""
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if len(rows) == len(seqs):
        tokens = sample_random(logits, seqs)
    else:
        tokens = logits.argmax(dim=-1)
        if rows:
            index = torch.tensor(rows, device=logits.device)
            tokens.index_copy_(0, index, sample_random(logits.index_select(0, index), [seqs[i] for i in rows]))
    token_list = tokens.tolist()
    return token_list, _logprobs(logits, seqs, token_list)


def sample_random(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One token per row from softmax(logits / T) restricted to each row's top-k and top-p."""
    device = logits.device
    floats = torch.tensor([[1.0 / s.params.temperature, s.params.top_p] for s in seqs], dtype=torch.float32)
    ints = torch.tensor(
        [[s.rng_key & MASK32, s.rng_key >> 32, s.num_output_tokens * DRAWS_PER_POSITION, s.params.top_k]
         for s in seqs], dtype=torch.int64,
    )
    floats, ints = floats.to(device, non_blocking=True), ints.to(device, non_blocking=True)
    inv_temp, top_p = floats[:, 0:1], floats[:, 1:2]
    key_lo, key_hi, counter, top_k = (ints[:, i : i + 1] for i in range(4))
    weights = torch.softmax(logits * inv_temp, dim=-1)
    vocab = weights.shape[1]
    max_k = max((s.params.top_k for s in seqs if s.params.top_k < vocab), default=0)
    if max_k > 0:
        weights = _mask_top_k(weights, torch.where(top_k < vocab, top_k, 0), max_k)
    cum = weights.cumsum(dim=-1)
    token = _draw(cum, key_lo, key_hi, counter)
    if all(s.params.top_p >= 1.0 for s in seqs):
        return token.squeeze(1)
    limit = top_p * cum[:, -1:]
    accepted = _in_nucleus(weights, token, limit)
    pending = (~accepted).squeeze(1).nonzero().squeeze(1)  # usually a few rows: redraw only those
    for round_ in range(1, REJECTION_ROUNDS):
        if not pending.numel():
            return token.squeeze(1)
        retry = _draw(cum[pending], key_lo[pending], key_hi[pending], counter[pending] + round_)
        ok = _in_nucleus(weights[pending], retry, limit[pending])
        token[pending] = torch.where(ok, retry, token[pending])
        pending = pending[~ok.squeeze(1)]
    if pending.numel():
        u = uniforms(key_lo[pending], key_hi[pending], counter[pending] + REJECTION_ROUNDS)
        token[pending, 0] = _sorted_nucleus(weights[pending], top_p[pending], u)
    return token.squeeze(1)


def _draw(cum: torch.Tensor, key_lo, key_hi, counter) -> torch.Tensor:
    """[B, 1] inverse-CDF draws: the first token whose cumulative weight exceeds u * total."""
    u = uniforms(key_lo, key_hi, counter)
    return torch.searchsorted(cum, u * cum[:, -1:], right=True).clamp_(max=cum.shape[1] - 1)


def _mask_top_k(weights: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    kth = weights.topk(max_k, dim=-1).values.gather(1, (top_k - 1).clamp(min=0, max=max_k - 1))
    kth = torch.where(top_k > 0, kth, torch.zeros_like(kth))
    return weights.masked_fill_(weights < kth, 0.0)


def _in_nucleus(weights: torch.Tensor, token: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """[B, 1] bool: the mass of tokens strictly heavier than `token` is below top_p of the total."""
    chosen = weights.gather(1, token)
    heavier = torch.where(weights > chosen, weights, 0.0).sum(dim=-1, keepdim=True)
    return heavier < limit


def _sorted_nucleus(weights: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Exact nucleus by sorting: the fallback for rows whose nucleus is a small share of the mass."""
    ordered, order = weights.sort(dim=-1, descending=True)
    cum = ordered.cumsum(dim=-1)
    total = cum[:, -1:]
    keep = (cum - ordered) < top_p * total
    cum = (ordered * keep).cumsum(dim=-1)
    pick = torch.searchsorted(cum, u * cum[:, -1:], right=True).clamp_(max=cum.shape[1] - 1)
    return order.gather(1, pick).squeeze(1)


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[tuple | None]:
    wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    result: list[tuple | None] = [None] * len(seqs)
    if not wanted:
        return result
    logp = torch.log_softmax(logits[wanted], dim=-1)
    max_k = max(seqs[i].params.logprobs for i in wanted)
    top_vals, top_ids = logp.topk(max_k, dim=-1) if max_k else (None, None)
    chosen = logp.gather(1, torch.tensor([[tokens[i]] for i in wanted], device=logits.device)).squeeze(1).tolist()
    for row, i in enumerate(wanted):
        k = seqs[i].params.logprobs
        ids = top_ids[row, :k].tolist() if k else []
        vals = top_vals[row, :k].tolist() if k else []
        result[i] = (chosen[row], ids, vals)
    return result
