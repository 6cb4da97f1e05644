"""Turns last-token logits into next tokens on the logits' device, one tensor pass for the batch.

Rows whose request asks for presence/frequency penalties or a logit_bias first get them applied to
their logits (penalties.py; other rows pay a flag check), so greedy argmax, sampling and the
reported logprobs all see the processed distribution (vLLM's "processed" logprobs, before temperature).
Greedy rows take the argmax. Random rows sample by inverse CDF: one counter-based uniform per draw
(see counter_rng) against the cumulative sum of exp(logits / T) in vocabulary order. min-p masks
below min_p times the row's largest weight (one max, no sort), then top-k masks below the k-th
weight (ties kept). top-p needs no sort: a drawn token is in the nucleus iff the
mass of strictly heavier tokens is below top_p, so draws are tested and redrawn with the next
counter (each round accepts with probability >= top_p); rows still unaccepted after REJECTION_ROUNDS
fall back to an exact sorted nucleus. A row accepted at round r takes draw r; the fallback uses the
uniform at counter + REJECTION_ROUNDS.

No step waits on the device before the tokens' one copy to the host. Rounds after the first run on a
fixed number of rows, sized on the host from the top-p values alone (twice the expected misses, plus
slack), that missed at round 0 (moved to the front by a stable sort), with `where` in place of
data-dependent indexing; the tokens travel with a per-row status, and only rows that status leaves
unsettled (round 0 missed but they were not among the redrawn rows, or every round missed; rare)
are finished after the copy, exactly as the plain loop would have, at the cost of a second round trip.
On CPU, where reading a flag waits on nothing, the rounds stop as soon as every redrawn row is settled
(same tokens; the fixed rounds cost 1.30x greedy in bench/bench_sampling.py, stopping early 1.15x).
`sample_async` queues all of it, with the copy, and returns (the engine's overlapped steps read the
tokens one step later, SampledTokens.result); `sample` is both at once.
A random row's constants (1 / temperature, top_p, min_p, top_k, key) sit in a device pool written once per
sequence (SamplingRows); a step sends each row's pool row and draw counter. Everything a row does
depends only on its own logits, key, position and output tokens, so a seeded request samples the same
tokens whatever shares its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bulkgen.engine.features.grammar import apply_masks
from bulkgen.engine.sampling.counter_rng import MASK32, uniforms
from bulkgen.engine.sampling.penalties import LogitAdjustments, adjust_logits
from bulkgen.engine.sequence import Sequence

DRAWS_PER_POSITION = 64  # counter = position * 64 + round
REJECTION_ROUNDS = 8
# Devices where reading a flag costs no synchronisation: there the rounds stop once every row is settled
# (later rounds would change nothing). On a GPU all rounds run, so nothing waits before the one copy.
EARLY_EXIT = frozenset({"cpu"})


@torch.inference_mode()
def sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    adjustments: LogitAdjustments | None = None,
    masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    constants: SamplingRows | None = None,
) -> tuple[list[int], list[tuple | None]]:
    """Return the next token of each row and, where tracked, (chosen logprob, top-k ids, top-k logprobs):
    `sample_async` and its result at once."""
    chosen, logprobs, _ = sample_async(logits, seqs, adjustments, masks, constants).result()
    return chosen, logprobs


@torch.inference_mode()
def sample_async(
    logits: torch.Tensor,
    seqs: list[Sequence],
    adjustments: LogitAdjustments | None = None,
    masks: tuple[torch.Tensor, torch.Tensor] | None = None,
    constants: SamplingRows | None = None,
) -> SampledTokens:
    """Queue the sampling of each row's next token and the tokens' copy to the host; wait for nothing.

    Changes `logits` in place (penalties and biases; `adjustments` keeps them across steps, see
    penalties.py; then the grammar `masks`: (rows, packed bitmask) of constrained rows, whose logprobs
    are therefore those of the masked distribution). The tokens cross to the host in one copy, with
    each row's top-p status; only rows left unsettled on the device (rare) cost a second round trip,
    in `SampledTokens.result`. `constants` keeps random rows' sampling constants on the device across
    steps (the engine's own)."""
    adjust_logits(logits, seqs, adjustments)
    if masks is not None:
        apply_masks(logits, *masks)
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    draw = None
    if len(rows) == len(seqs):
        draw = sample_random(logits, seqs, constants)
        tokens, status = draw.tokens, draw.status
    else:
        tokens, status = logits.argmax(dim=-1), None
        if rows:
            index = torch.tensor(rows).to(logits.device, non_blocking=True)
            draw = sample_random(logits.index_select(0, index), [seqs[i] for i in rows], constants)
            tokens.index_copy_(0, index, draw.tokens)
            if draw.status is not None:
                status = torch.zeros_like(tokens).index_copy_(0, index, draw.status)
    if status is None:
        draw = None  # nothing to settle: free its [B, vocab] weights and cumulative sums now
    return SampledTokens(tokens, status, draw, rows, _LogprobRows.launch(logits, seqs, tokens))


class SampledTokens:
    """One step's tokens on the device and their copy to the host, started at construction.

    `tokens` is final on the device for every row the status calls settled, so a next step may read it
    before the host has (the engine's overlapped steps). `result()` waits for the copy alone: on CUDA for
    an event recorded behind it, not for the stream, so work queued after it (the next step's forward)
    runs on; then it finishes the rare unsettled rows (RandomDraw.settle, which does wait) and reports
    their indices, whose device tokens were wrong until then. While a result is pending, the draw
    of a top-p step and the logprob rows stay alive (what settling and late logprobs need)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        status: torch.Tensor | None,
        draw: RandomDraw | None,
        rows: list[int],
        logprobs: _LogprobRows,
    ) -> None:
        self.tokens, self.draw, self.rows, self.logprobs = tokens, draw, rows, logprobs
        packed = tokens if status is None else torch.stack((tokens, status))
        self._host, self._event = _copy_to_host([packed, *logprobs.device_parts()])
        self._result: tuple[list[int], list[tuple | None], list[int]] | None = None

    @torch.inference_mode()
    def result(self) -> tuple[list[int], list[tuple | None], list[int]]:
        """(tokens, logprobs, late): `late` are the rows settled only now (their device token changed)."""
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()
        packed = self._host[0].tolist()
        if self.draw is None:
            chosen, late = packed, []
        else:
            chosen, flags = packed
            late = [i for i, flag in enumerate(flags) if flag]
            if late:
                self._settle(chosen, late, [flags[i] for i in late])
        self._result = chosen, self.logprobs.result(self._host[1:], self.tokens, late), late
        self.draw = self.logprobs.logp = None
        return self._result

    def _settle(self, chosen: list[int], late: list[int], flags: list[int]) -> None:
        row_of = {seq_row: row for row, seq_row in enumerate(self.rows)}
        settled = self.draw.settle([row_of[i] for i in late], flags)
        self.tokens.index_copy_(0, torch.tensor(late).to(self.tokens.device, non_blocking=True), settled)
        for i, token in zip(late, settled.tolist(), strict=True):
            chosen[i] = token


def _copy_to_host(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], object | None]:
    """Host copies of `parts`, queued without waiting (pinned on CUDA), and an event behind them."""
    if not parts or parts[0].device.type == "cpu":
        return parts, None
    host = [t.to("cpu", non_blocking=True) for t in parts]
    event = torch.cuda.Event()
    event.record()
    return host, event


class SamplingRows:
    """Random-sampling sequences' constants on the logits' device: row r of a float pool holds
    (1 / temperature, top_p, min_p) and of an int pool (key low half, key high half, top_k), written once when
    the sequence first samples. A step then sends one [2, B] int tensor, each row's pool row and draw
    counter (position * DRAWS_PER_POSITION), and gathers the rest on the device. The engine releases a
    sequence's row when its request finishes or is aborted and drops the pools on reset."""

    def __init__(self) -> None:
        self.floats: torch.Tensor | None = None
        self.ints: torch.Tensor | None = None
        self.free: list[int] = []
        self.rows: dict[int, int] = {}  # by seq_id

    def gather(
        self, seqs: list[Sequence], vocab: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([B, 3] float32 constants, [B, 3] int64 constants, [B, 1] int64 counters) of `seqs`."""
        rows, counters, fresh = [], [], []
        for seq in seqs:
            row = self.rows.get(seq.seq_id)
            if row is None:
                row = self.rows[seq.seq_id] = self._take(device)
                fresh.append((row, seq))
            rows.append(row)
            counters.append(seq.num_output_tokens * DRAWS_PER_POSITION)
        if fresh:
            self._write(fresh, vocab, device)
        index = torch.tensor([rows, counters], dtype=torch.int64).to(device, non_blocking=True)
        return self.floats.index_select(0, index[0]), self.ints.index_select(0, index[0]), index[1][:, None]

    def release(self, seq: Sequence) -> None:
        row = self.rows.pop(seq.seq_id, None)
        if row is not None:
            self.free.append(row)

    def _take(self, device: torch.device) -> int:
        if not self.free:
            size = 0 if self.floats is None else self.floats.shape[0]
            grown = max(64, 2 * size)
            floats = torch.zeros(grown - size, 3, dtype=torch.float32, device=device)
            ints = torch.zeros(grown - size, 3, dtype=torch.int64, device=device)
            self.floats = floats if self.floats is None else torch.cat([self.floats, floats])
            self.ints = ints if self.ints is None else torch.cat([self.ints, ints])
            self.free = list(range(grown - 1, size - 1, -1))
        return self.free.pop()

    def _write(self, fresh: list[tuple[int, Sequence]], vocab: int, device: torch.device) -> None:
        index = torch.tensor([row for row, _ in fresh], dtype=torch.int64).to(device, non_blocking=True)
        floats = torch.tensor(
            [[1.0 / s.params.temperature, s.params.top_p, s.params.min_p] for _, s in fresh],
            dtype=torch.float32,
        )
        ints = torch.tensor(
            [[s.rng_key & MASK32, s.rng_key >> 32, min(s.params.top_k, vocab)] for _, s in fresh],
            dtype=torch.int64,
        )
        self.floats.index_copy_(0, index, floats.to(device, non_blocking=True))
        self.ints.index_copy_(0, index, ints.to(device, non_blocking=True))


SETTLED, SKIPPED, EXHAUSTED = 0, 1, 2  # RandomDraw.status values


@dataclass
class RandomDraw:
    """One token per row on the device, and (when some row has a top-p) each row's status: SETTLED, or
    SKIPPED (its round-0 draw missed the nucleus and it was not among the rows redrawn) or EXHAUSTED
    (every round missed); `settle` finishes those rows as the plain rejection loop would have."""

    tokens: torch.Tensor
    status: torch.Tensor | None = None
    state: tuple[torch.Tensor, ...] = ()  # cum, weights, limit, top_p, draws (every round's uniform)

    def settle(self, rows: list[int], status: list[int]) -> torch.Tensor:
        """The tokens of `rows` (with their host-side `status`): the remaining rounds for SKIPPED rows,
        then the sorted nucleus for rows no round accepted. May synchronise; it is the rare path."""
        device = self.tokens.device
        index = torch.tensor(rows).to(device, non_blocking=True)
        cum, weights, limit, top_p, u = (t.index_select(0, index) for t in self.state)
        exhausted = torch.tensor(status).to(device, non_blocking=True)[:, None] == EXHAUSTED
        start = self.tokens.index_select(0, index)[:, None]  # round 0's draw: neither kind replaced it
        token, done = _redraw(cum, weights, limit, u, start, exhausted)
        nucleus = _sorted_nucleus(weights, top_p, u[:, REJECTION_ROUNDS:])
        return torch.where((exhausted | ~done).squeeze(1), nucleus, token.squeeze(1))


def sample_random(
    logits: torch.Tensor, seqs: list[Sequence], constants: SamplingRows | None = None
) -> RandomDraw:
    """One token per row from softmax(logits / T) restricted to each row's min-p, top-k and top-p, without a
    host synchronisation: rows whose round-0 draw misses the nucleus are moved to the front and a
    fixed number of them (sized on the host from the top-p values) are redrawn for the remaining
    rounds; any other row is left to RandomDraw.settle."""
    batch, vocab = logits.shape
    floats, ints, counter = (constants or SamplingRows()).gather(seqs, vocab, logits.device)
    inv_temp, top_p, min_p = floats[:, 0:1], floats[:, 1:2], floats[:, 2:3]
    key_lo, key_hi, top_k = (ints[:, i : i + 1] for i in range(3))
    weights = torch.softmax(logits * inv_temp, dim=-1)
    if any(s.params.min_p > 0 for s in seqs):  # vLLM's order: min-p before top-k and top-p
        weights = weights.masked_fill_(weights < min_p * weights.amax(dim=-1, keepdim=True), 0.0)
    max_k = max((s.params.top_k for s in seqs if s.params.top_k < vocab), default=0)
    if max_k > 0:
        weights = _mask_top_k(weights, torch.where(top_k < vocab, top_k, 0), max_k)
    cum = weights.cumsum(dim=-1)
    if all(s.params.top_p >= 1.0 for s in seqs):
        return RandomDraw(_draw(cum, uniforms(key_lo, key_hi, counter)).squeeze(1))
    # every round's uniform (and the sorted fallback's, last) in one hash: [B, REJECTION_ROUNDS + 1]
    u = uniforms(key_lo, key_hi, counter + torch.arange(REJECTION_ROUNDS + 1, device=counter.device))
    token = _draw(cum, u[:, :1])
    limit = top_p * cum[:, -1:]
    accepted = _in_nucleus(weights, token, limit)
    state = (cum, weights, limit, top_p, u)
    redrawn = min(batch, _redrawn_rows(seqs))
    if redrawn == batch:
        token, done = _redraw(cum, weights, limit, u, token, accepted)
        status = torch.where(done, SETTLED, EXHAUSTED).squeeze(1)
    else:
        index = torch.argsort(accepted.squeeze(1).to(torch.int8), stable=True)[:redrawn]
        picked, done = _redraw(*(t.index_select(0, index) for t in (cum, weights, limit, u, token, accepted)))
        token.index_copy_(0, index, picked)
        status = torch.where(accepted, SETTLED, SKIPPED).squeeze(1)
        status.index_copy_(0, index, torch.where(done, SETTLED, EXHAUSTED).squeeze(1))
    return RandomDraw(token.squeeze(1), status, state)


def _redrawn_rows(seqs: list[Sequence]) -> int:
    """How many rows get rounds 1..: a row's round 0 misses with probability <= 1 - top_p, so twice
    the expected misses plus slack (more misses only cost RandomDraw.settle)."""
    return math.ceil(2 * sum(max(0.0, 1.0 - s.params.top_p) for s in seqs)) + 8


def _redraw(cum, weights, limit, u, token, done) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounds 1.. of the rejection loop over fixed-shape [R, 1] rows (`u`: each row's uniforms, round r's in
    column r): a row not `done` takes the first redraw inside its nucleus. Returns (token, done). Where a
    flag read is free (EARLY_EXIT) the rounds stop once every row is settled; elsewhere every round's draw
    comes from one search (on a GPU each small op costs the host a launch: a round is a handful of ops)."""
    early = done.device.type in EARLY_EXIT
    retries = None if early else _draw(cum, u[:, 1:REJECTION_ROUNDS])
    for round_ in range(1, REJECTION_ROUNDS):
        if early and bool(done.all()):
            break
        retry = _draw(cum, u[:, round_ : round_ + 1]) if early else retries[:, round_ - 1 : round_]
        ok = _in_nucleus(weights, retry, limit)
        token = torch.where(~done & ok, retry, token)
        done = done | ok
    return token, done


def _draw(cum: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B, K] inverse-CDF draws for uniforms `u` [B, K]: the first token whose cumulative weight exceeds
    u * total."""
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


class _LogprobRows:
    """Logprobs of the rows that track them (asked for, or best_of ranking): one log_softmax over those
    rows only, a gather of the chosen tokens and top-k where asked, queued with the tokens; read with
    them. A row settled late has its chosen logprob gathered again from the kept log-softmax."""

    def __init__(self, size: int, wanted: list[int], ks: list[int], logp, chosen, top) -> None:
        self.size, self.wanted, self.ks = size, wanted, ks  # rows, those tracked, their top-k counts
        self.logp, self.chosen, self.top = logp, chosen, top  # device: [W, vocab], [W], (ids, values)

    @classmethod
    def launch(cls, logits: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor) -> _LogprobRows:
        wanted = [i for i, s in enumerate(seqs) if s.cumulative_logprob is not None]
        if not wanted:
            return cls(len(seqs), [], [], None, None, ())
        index = torch.tensor(wanted).to(logits.device, non_blocking=True)
        logp = torch.log_softmax(logits.index_select(0, index), dim=-1)
        chosen = logp.gather(1, tokens.index_select(0, index)[:, None]).squeeze(1)
        ks = [seqs[i].params.logprobs or 0 for i in wanted]
        max_k = max(ks)
        top = logp.topk(max_k, dim=-1) if max_k else ()
        return cls(len(seqs), wanted, ks, logp, chosen, (top.indices, top.values) if max_k else ())

    def device_parts(self) -> list[torch.Tensor]:
        return [] if self.chosen is None else [self.chosen, *self.top]

    def result(self, host: list[torch.Tensor], tokens: torch.Tensor, late: list[int]) -> list[tuple | None]:
        out: list[tuple | None] = [None] * self.size
        if not self.wanted:
            return out
        chosen = host[0].tolist()
        settled_late = set(late)
        redo = [(row, i) for row, i in enumerate(self.wanted) if i in settled_late]
        if redo:  # their tokens changed after the gather
            where = torch.tensor([row for row, _ in redo]).to(self.logp.device, non_blocking=True)
            picked = tokens.index_select(0, torch.tensor([i for _, i in redo]).to(tokens.device))
            fixed = self.logp.index_select(0, where).gather(1, picked[:, None]).squeeze(1).tolist()
            for (row, _), value in zip(redo, fixed, strict=True):
                chosen[row] = value
        if host[1:]:
            ids, vals = host[1].tolist(), host[2].tolist()
            ids = [r[:k] for r, k in zip(ids, self.ks, strict=True)]
            vals = [r[:k] for r, k in zip(vals, self.ks, strict=True)]
        else:
            ids = vals = [[] for _ in self.wanted]
        for row, i in enumerate(self.wanted):
            out[i] = (chosen[row], ids[row], vals[row])
        return out


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
