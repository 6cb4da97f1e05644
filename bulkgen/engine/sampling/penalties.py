"""Repetition, presence and frequency penalties and logit_bias, applied to the rows that ask for them.

OpenAI's formula, per row: logits[t] += logit_bias[t] - frequency_penalty * count[t]
- presence_penalty * (count[t] > 0), where count[t] counts t among the sequence's output tokens (the
prompt does not count). Each asking sequence owns one row of a pool on the logits' device holding that
whole additive term for every token. The row is built once (zeros plus the bias); afterwards a step
rewrites only the entries of the tokens appended since the sequence's last step (usually one), with
the value computed exactly on the host from the token's count, so the host work per step is
O(asking rows) whatever the output length, and the device work two passes over those rows' logits.
A repetition_penalty p (vLLM's and transformers' definition, applied first, as vLLM does) divides the
positive logits and multiplies the negative ones of every token seen in the prompt or the output: a
second, boolean pool marks each asking row's seen tokens (the prompt's when the row is built, then the
new tokens each step). Rows without penalties or biases are not touched, and each row's result depends only on its own logits
and tokens, so the counter-based sampling stays batch-independent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bulkgen.engine.sequence import Sequence

MIN_POOL_ROWS = 8


@dataclass
class _Row:
    index: int  # row of the pool
    counted: int = 0  # output tokens already folded into the row
    counts: dict[int, int] = field(default_factory=dict)


class LogitAdjustments:
    """A [rows, vocab] float32 pool: row r is what its sequence adds to its logits this step.

    The engine releases a sequence's row when its request finishes or is aborted and drops the pool on
    reset. A row only ever catches up with the host tokens, which are the truth: a failed or repeated
    step, or a preemption, leaves nothing to undo."""

    def __init__(self) -> None:
        self.pool: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None  # [rows, vocab] bool: tokens of the prompt or output
        self.free: list[int] = []
        self.rows: dict[int, _Row] = {}  # by seq_id

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Add each asking row's adjustment to `logits` in place; the other rows pay a flag check."""
        rows = [i for i, s in enumerate(seqs) if s.adjusts_logits]
        if not rows:
            return
        device, vocab = logits.device, logits.shape[1]
        updates: dict[tuple[int, int], float] = {}
        seen: list[tuple[int, int]] = []  # (pool row, token) newly seen by a repetition-penalty row
        pool_rows = [self._catch_up(seqs[i], vocab, device, updates, seen) for i in rows]
        if seen:
            index = torch.tensor(seen, dtype=torch.int64).to(device, non_blocking=True)
            self.seen.index_put_((index[:, 0], index[:, 1]), torch.ones((), dtype=torch.bool, device=device))
        self._repetition(logits, seqs, rows, pool_rows)
        if updates:  # one (row, token) entry each: set, not added, so the values stay exact
            index = torch.tensor(list(zip(*updates, strict=True)), dtype=torch.int64).to(
                device, non_blocking=True
            )
            values = torch.tensor(list(updates.values()), dtype=torch.float32).to(device, non_blocking=True)
            self.pool.index_put_((index[0], index[1]), values)
        ints = torch.tensor([rows, pool_rows], dtype=torch.int64).to(device, non_blocking=True)
        logits.index_add_(0, ints[0], self.pool.index_select(0, ints[1]))

    def _repetition(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], pool_rows: list[int]):
        picked = [
            (i, r) for i, r in zip(rows, pool_rows, strict=True) if seqs[i].params.repetition_penalty != 1
        ]
        if not picked:
            return
        penalty = torch.tensor([[seqs[i].params.repetition_penalty] for i, _ in picked], dtype=logits.dtype)
        ints = torch.tensor(list(zip(*picked, strict=True)), dtype=torch.int64).to(
            logits.device, non_blocking=True
        )
        penalty = penalty.to(logits.device, non_blocking=True)
        sub = logits.index_select(0, ints[0])
        scaled = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits.index_copy_(0, ints[0], torch.where(self.seen.index_select(0, ints[1]), scaled, sub))

    def release(self, seq: Sequence) -> None:
        row = self.rows.pop(seq.seq_id, None)
        if row is not None:
            self.free.append(row.index)

    def _catch_up(
        self,
        seq: Sequence,
        vocab: int,
        device: torch.device,
        updates: dict[tuple[int, int], float],
        seen: list[tuple[int, int]],
    ) -> int:
        row = self.rows.get(seq.seq_id)
        repeats = seq.params.repetition_penalty != 1
        if row is None:
            row = self.rows[seq.seq_id] = _Row(self._take(seq, vocab, device))
            if repeats:
                seen.extend((row.index, t) for t in set(seq.token_ids[: seq.num_prompt_tokens]))
        fresh = seq.token_ids[seq.num_prompt_tokens + row.counted :]
        if fresh:
            params = seq.params
            if repeats:
                seen.extend((row.index, t) for t in set(fresh))
            bias = params.logit_bias or {}
            for token in fresh:
                count = row.counts[token] = row.counts.get(token, 0) + 1
                updates[row.index, token] = (
                    bias.get(token, 0.0) - params.frequency_penalty * count - params.presence_penalty
                )
            row.counted += len(fresh)
        return row.index

    def _take(self, seq: Sequence, vocab: int, device: torch.device) -> int:
        if not self.free:
            size = 0 if self.pool is None else self.pool.shape[0]
            grown = max(MIN_POOL_ROWS, 2 * size)
            extra = torch.zeros(grown - size, vocab, dtype=torch.float32, device=device)
            self.pool = extra if self.pool is None else torch.cat([self.pool, extra])
            marks = torch.zeros(grown - size, vocab, dtype=torch.bool, device=device)
            self.seen = marks if self.seen is None else torch.cat([self.seen, marks])
            self.free = list(range(grown - 1, size - 1, -1))
        index = self.free.pop()
        self.pool[index].zero_()
        self.seen[index].zero_()
        bias = seq.params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.int64, device=device)
            self.pool[index].index_put_(
                (ids,), torch.tensor(list(bias.values()), dtype=torch.float32, device=device)
            )
        return index


def adjust_logits(
    logits: torch.Tensor, seqs: list[Sequence], adjustments: LogitAdjustments | None = None
) -> None:
    """Apply penalties and logit_bias in place. `adjustments` keeps the rows between steps (the engine
    passes its own); without it each asking row is built afresh from its tokens."""
    (adjustments or LogitAdjustments()).apply(logits, seqs)
