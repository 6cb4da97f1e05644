"""Turns last-token logits into next tokens on the logits' device, one tensor pass for the batch.

Rows whose request asks for presence/frequency penalties or a logit_bias first get them applied to
their logits (penalties.py; other rows pay a flag check), so greedy argmax, sampling and the
reported logprobs all see the processed distribution (vLLM's "processed" logprobs, before temperature).
Greedy rows take the argmax. Random rows sample by inverse CDF: one counter-based uniform per draw
(see counter_rng) against the cumulative sum of exp(logits / T) in vocabulary order. top-k masks
below the k-th weight (ties kept). top-p needs no sort: a drawn token is in the nucleus iff the
mass of strictly heavier tokens is below top_p, so draws are tested and redrawn with the next
counter (each round accepts with probability >= top_p); rows still unaccepted after a few rounds
fall back to an exact sorted nucleus. Everything a row does depends only on its own logits, key,
position and output tokens, so a seeded request samples the same tokens whatever shares its batch.
"""

from __future__ import annotations

import torch

from .counter_rng import MASK32, uniforms
from .grammar import apply_masks
from .penalties import LogitAdjustments, adjust_logits
from .sequence import Sequence

DRAWS_PER_POSITION = 64  # counter = position * 64 + round
REJECTION_ROUNDS = 8


@torch.inference_mode()
def sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    adjustments: LogitAdjustments | None = None,
    masks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[list[int], list[tuple | None]]:
    """Return the next token of each row and, where tracked, (chosen logprob, top-k ids, top-k logprobs).

    Changes `logits` in place (penalties and biases; `adjustments` keeps them across steps, see
    penalties.py; then the grammar `masks`: (rows, packed bitmask) of constrained rows, whose logprobs
    are therefore those of the masked distribution). The sampled tokens cross to the host in one copy."""
    adjust_logits(logits, seqs, adjustments)
    if masks is not None:
        apply_masks(logits, *masks)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if len(rows) == len(seqs):
        tokens = sample_random(logits, seqs)
    else:
        tokens = logits.argmax(dim=-1)
        if rows:
            index = torch.tensor(rows, device=logits.device)
            tokens.index_copy_(
                0, index, sample_random(logits.index_select(0, index), [seqs[i] for i in rows])
            )
    logprobs = _logprobs(logits, seqs, tokens)
    return tokens.tolist(), logprobs


def sample_random(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One token per row from softmax(logits / T) restricted to each row's top-k and top-p."""
    device, vocab = logits.device, logits.shape[1]
    floats = torch.tensor([[1.0 / s.params.temperature, s.params.top_p] for s in seqs], dtype=torch.float32)
    ints = torch.tensor(
        [
            [
                s.rng_key & MASK32,
                s.rng_key >> 32,
                s.num_output_tokens * DRAWS_PER_POSITION,
                min(s.params.top_k, vocab),
            ]
            for s in seqs
        ],
        dtype=torch.int64,
    )
    floats, ints = floats.to(device, non_blocking=True), ints.to(device, non_blocking=True)
    inv_temp, top_p = floats[:, 0:1], floats[:, 1:2]
    key_lo, key_hi, counter, top_k = (ints[:, i : i + 1] for i in range(4))
    weights = torch.softmax(logits * inv_temp, dim=-1)
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


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor) -> list[tuple | None]:
    """For rows tracking logprobs (asked for, or best_of ranking): one log_softmax over those rows only,
    a gather of the chosen tokens, and top-k where asked."""
    wanted = [i for i, s in enumerate(seqs) if s.cumulative_logprob is not None]
    result: list[tuple | None] = [None] * len(seqs)
    if not wanted:
        return result
    index = torch.tensor(wanted, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index), dim=-1)
    chosen = logp.gather(1, tokens.index_select(0, index)[:, None]).squeeze(1).tolist()
    ks = [seqs[i].params.logprobs or 0 for i in wanted]
    top_ids, top_vals = top_logprobs(logp, ks)
    for row, i in enumerate(wanted):
        result[i] = (chosen[row], top_ids[row], top_vals[row])
    return result


def top_logprobs(logp: torch.Tensor, ks: list[int]) -> tuple[list[list[int]], list[list[float]]]:
    """Row r's ks[r] most likely token ids and their logprobs (two host copies for all rows)."""
    max_k = max(ks, default=0)
    if not max_k:
        return [[] for _ in ks], [[] for _ in ks]
    vals, ids = logp.topk(max_k, dim=-1)
    ids, vals = ids.tolist(), vals.tolist()
    return [r[:k] for r, k in zip(ids, ks, strict=True)], [r[:k] for r, k in zip(vals, ks, strict=True)]


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[tuple]:
    """(logprob of each row's target, top-k ids, top-k logprobs) from the raw model distribution:
    prompt positions have no output tokens, and prompt logprobs describe the model, not the request."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, torch.tensor(targets, device=logits.device)[:, None]).squeeze(1).tolist()
    ids, vals = top_logprobs(logp, ks)
    return list(zip(chosen, ids, vals, strict=True))
