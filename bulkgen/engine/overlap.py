"""Overlapped steps: the engine's path that launches a step before reading the previous one's tokens.

The mechanism is described in engine.py's module docstring; this module holds that path alone, so the
step-by-step path (`Engine._step_in_order`) reads as one straight line beside it. Each sequence that
sampled in the launched step holds a stand-in token (sequence.pending_id) until the host reads the step's
tokens one step later (`_InFlight`); a sequence that ended, or whose stand-in was corrected late, in the
meantime has its token of the step launched on it discarded.
"""

from __future__ import annotations

import time

import torch

from bulkgen.engine.outputs import RequestOutput
from bulkgen.engine.sampling.sampler import SampledTokens, sample_async
from bulkgen.engine.scheduler import ScheduledBatch
from bulkgen.engine.sequence import Sequence, SequenceStatus, pending_id


class _InFlight:
    """A launched step whose tokens the host has not read: its sampled tokens and its sampling rows.
    Row i's sequence holds token i while its last token id is the stand-in sequence.pending_id(i)."""

    def __init__(self, sampled: SampledTokens, seqs: list[Sequence]) -> None:
        self.sampled, self.seqs = sampled, seqs


class OverlappedSteps:
    """Engine methods of the overlapped path (a mixin: they use the engine's scheduler, runner and
    result building, and its `_inflight` step)."""

    _inflight: _InFlight | None

    def _step_overlapped(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Launch this step on the previous step's stand-in tokens, then read the previous step's tokens
        while this one runs, and leave this one in flight."""
        start = time.time()
        prev = self._inflight
        # rows whose logits processing reads their tokens on the host (a grammar's matcher, penalties,
        # logit_bias) sample once the previous step's tokens are read; the forward still runs meanwhile
        late = prev is not None and bool(self._host_bound) and self._needs_host_tokens(batch)
        pending = None if prev is None else prev.sampled.tokens
        step, sampled, scored = self._launch(batch, pending, sample=not late, now=start)
        theirs = prev.sampled.result() if prev is not None else None
        # no sequence changed up to here
        done, voided = [], set()
        if prev is not None:
            self._inflight = None
            done, voided = self._resolve(prev, theirs)
        discarded = self._advance(batch, voided)
        if voided:
            self._void(batch, voided)
        for seq, entries in scored:
            seq.request.prompt_logprobs.extend(entries)
        sampling = step.sampling
        if late and sampling:
            sampling, sampled = self._sample_late(step, voided)
        held = self._hold(sampling, sampled, voided) if sampled is not None else []
        done += self._finish_prefilled(step.prefilled)
        self.stats_.record_step(batch, time.time() - start, held, discarded)
        return done

    def _void(self, batch: ScheduledBatch, voided: set[int]) -> None:
        """Tell the step feature of each sequence launched on a token corrected late (a hybrid model's
        state absorbed the wrong token: it starts over)."""
        for seq, _ in batch.items:
            if seq.seq_id in voided:
                self.runner.states.on_void(seq, self.scheduler.recompute)

    def _needs_host_tokens(self, batch: ScheduledBatch) -> bool:
        """A row whose logits processing reads its tokens on the host: a grammar's matcher, or penalties
        and logit_bias (their device rows catch up from the host's tokens)."""
        return any(s.matcher is not None or s.adjusts_logits for s, _ in batch.items)

    def _sample_late(self, step, voided: set[int]) -> tuple[list[Sequence], SampledTokens | None]:
        """Sample the step's rows whose sequences still run, once the previous step's tokens are in
        (matchers advanced, penalty counts caught up); returns those sequences and their tokens."""
        finished = SequenceStatus.FINISHED
        rows = [i for i, s in enumerate(step.sampling) if s.status is not finished and s.seq_id not in voided]
        live = [step.sampling[i] for i in rows]
        if not live:
            return [], None
        logits = step.logits[: len(step.sampling)]
        if len(live) < len(step.sampling):
            logits = logits.index_select(0, torch.tensor(rows).to(logits.device, non_blocking=True))
        guided = [s for s in live if s.matcher is not None]
        masks = None
        if guided:
            _, fill = self._fill_masks(guided)
            masks = self._constrained_rows(live, guided, fill.result())
        return live, sample_async(logits, live, self.adjustments, masks, self.constants)

    def _hold(self, sampling: list[Sequence], sampled: SampledTokens, voided: set[int]) -> list[Sequence]:
        """Give each sequence that sampled in the step just launched a stand-in token (read by the next
        forward on the device, by the host in the next step); one whose token is its last (max_tokens)
        leaves the batch now. Returns the sequences that hold one."""
        finished, kept = SequenceStatus.FINISHED, sampling
        for row, seq in enumerate(sampling):
            if seq.status is finished or (voided and seq.seq_id in voided):
                if kept is sampling:
                    kept = sampling[:row]
                continue  # its token is discarded
            tokens = seq.token_ids
            tokens.append(pending_id(row))
            if kept is not sampling:
                kept.append(seq)
            if len(tokens) - seq.num_prompt_tokens >= seq.max_tokens:
                self.scheduler.finish(seq)  # whatever the token, it ends the sequence
        self._inflight = _InFlight(sampled, sampling)
        return kept

    def _resolve(self, prev: _InFlight, result: tuple) -> tuple[list[RequestOutput], set[int]]:
        """Fill the previous step's stand-in tokens with what the host read and run their stop checks.
        Returns the requests finished and the sequences whose device token was corrected late: the
        step launched on it computed a wrong token for them."""
        chosen, logprobs, late = result
        seqs = prev.seqs
        voided = {seqs[row].seq_id for row in late if seqs[row].token_ids[-1] == pending_id(row)}
        return self._take_tokens(seqs, chosen, logprobs, placed=True), voided

    def _drain(self) -> list[RequestOutput]:
        """Read the in-flight step's tokens when there is no step to launch."""
        prev = self._inflight
        result = prev.sampled.result()
        self._inflight = None
        return self._resolve(prev, result)[0]
