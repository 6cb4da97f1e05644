"""Decides, every step, which sequences run and how many tokens each computes.

Running sequences go first (decodes before unfinished prefills, so a long prompt never stalls
decodes), each bounded by the per-step token budget; then waiting sequences are admitted while slots,
budget and KV blocks allow, in the order of the waiting queue (waiting.py: fair between tags, so
between batches, then longest first). When a running sequence needs a block and none is free, the most recently
admitted sequence is preempted: its blocks are freed and it is recomputed later (nothing is lost).
Before a running sequence grows, its sliding-window and chunked KV groups give back the blocks its next
tokens no longer read (block_manager.slide), so a long context in a windowed model holds little more
than its full-attention layers' blocks.

This is continuous batching: admit whenever there is room. Another admission rule (the static and
dynamic batching that `bulkgen bench` compares against it, bulkgen/lab/grouped.py) subclasses Scheduler
and overrides its hooks: `_admission_open`, `_next_candidate`/`_pop_candidate`, `held`, `idle_wait`.

In a model whose image tokens attend to their whole image (Gemma 3), a prefill chunk never ends inside
an image block: it stops at the block's start or takes the block whole, past the step's budget by at most
one block (image_blocks.py).

A prompt_logprobs prefill needs logits at every prompt position: it takes no cached prefix blocks, and
its chunks are capped at PROMPT_LOGIT_ROWS tokens per step (all such sequences together), so the
[rows, vocab] logits of a long prompt never exhaust memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from bulkgen.engine.config import EngineConfig
from bulkgen.engine.features.image_blocks import whole_blocks
from bulkgen.engine.kv.block_manager import BlockManager
from bulkgen.engine.sequence import Sequence, SequenceStatus
from bulkgen.engine.step_features import NO_FEATURE, StepFeature
from bulkgen.engine.waiting import WaitingQueue

PROMPT_LOGIT_ROWS = 1024


@dataclass
class ScheduledBatch:
    """One step's decision: (sequence, tokens to compute) pairs plus the slot accounting for metrics."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    is_decode: list[bool] = field(default_factory=list)  # per item
    held: list[Sequence] = field(default_factory=list)  # sequences holding a slot this step
    held_slots: int = 0
    padding_slots: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0


class Scheduler:
    """Owns the queues (waiting, preempted, running); the engine calls schedule() per step."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, features: StepFeature = NO_FEATURE):
        """`features`: the engine's step features that hold something per running sequence (a hybrid model's
        state slots, LoRA adapters' rows: step_features.Features); admission asks them for room and fit, as
        it asks the block manager."""
        self.config = config
        self.bm = block_manager
        self.features = features
        self.waiting = WaitingQueue(config.admission)  # fair between tags, then the admission order
        self.preempted: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefill_padding_tokens = 0  # prompts padded to a group's longest; packed prompts pad none
        self._logit_rows = PROMPT_LOGIT_ROWS  # prompt-logprob rows left in the step being scheduled

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._logit_rows = PROMPT_LOGIT_ROWS
        before = self.num_preemptions
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if self.num_preemptions == before:
            self._admit(batch, budget)
        batch.held = self.held()
        batch.held_slots = len(batch.held)
        batch.padding_slots = sum(s.status is SequenceStatus.FINISHED for s in batch.held)
        for seq, n in batch.items:  # attributes, not properties: this runs for every row of every step
            length = len(seq.token_ids)
            is_decode = n == 1 and length > seq.num_prompt_tokens and seq.num_computed_tokens == length - 1
            batch.is_decode.append(is_decode)
            if is_decode:
                batch.decode_tokens += 1
            else:
                batch.prefill_tokens += n
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        order = sorted(self.running, key=lambda s: len(s.token_ids) - s.num_computed_tokens != 1)
        scheduled: set[int] = set()
        running, bs = SequenceStatus.RUNNING, self.bm.block_size
        for seq in order:
            if budget <= 0:  # below zero after a chunk took an image block whole (image_blocks.py)
                break
            if seq.status is not running:
                continue  # preempted earlier in this loop
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if seq.scores_prompt:
                n = self._prompt_rows(seq, n)
            if seq.request.images is not None:  # a chunk never splits an image block (image_blocks.py)
                n = whole_blocks(seq, seq.num_computed_tokens, n)
            if not n:
                continue
            self.bm.slide(seq)  # blocks behind a window are free for the growth below
            end = seq.num_computed_tokens + n
            if end > len(seq.block_table) * bs and not self._make_room(seq, end, scheduled):
                continue
            batch.items.append((seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
        return budget

    def _prompt_rows(self, seq: Sequence, n: int) -> int:
        """`n` capped by the step's prompt-logit rows left, for a sequence whose prompt is being scored."""
        if not seq.needs_prompt_logprobs:
            return n
        n = min(n, self._logit_rows)
        self._logit_rows -= n
        return n

    def _make_room(self, seq: Sequence, num_tokens: int, scheduled: set[int]) -> bool:
        """Grow `seq` to `num_tokens`, preempting the newest unscheduled sequences; False if `seq` itself went."""
        while not self.bm.grow(seq, num_tokens):
            victims = [s for s in self.running if s.seq_id not in scheduled and s is not seq]
            victim = victims[-1] if victims else seq
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.preempted.appendleft(seq)

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        if not self._admission_open():
            return
        computing: set[int] = set()  # first-block hashes that sequences admitted now compute from scratch
        features = self.features
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self._next_candidate()
            if seq is not None and not features.fits(seq):
                seq = self._other_candidate(features.fits)
            if seq is None:
                return
            scoring = seq.computes_whole_prompt  # a cache hit would skip prompt logits or pooled rows
            cached = None if scoring else self.bm.match_prefix(seq)
            first = None if cached else self.bm.first_block_hash(seq)
            if first is not None and first in computing and not scoring:
                return  # its prefix is being computed now: admit it next step, as a cache hit
            skipped = len(cached) * self.bm.block_size if cached else 0
            n = self._prompt_rows(seq, min(len(seq) - skipped, budget))
            n = whole_blocks(seq, skipped, n)
            if not n or not features.has_room() or not self.bm.admit(seq, cached, skipped + n):
                return
            features.take(seq)
            self._pop_candidate(seq)
            if first is not None:
                computing.add(first)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.items.append((seq, n))
            budget -= n

    def _other_candidate(self, accept) -> Sequence | None:
        """A waiting sequence `accept` takes, when the next in line does not fit beside the running ones (a
        LoRA adapter waits for a free slot while sequences of running adapters go ahead: lora_slots.py)."""
        return self.waiting.peek(accept)

    def _admission_open(self) -> bool:
        """Whether this step may admit at all (continuous: always; room is checked per sequence)."""
        return True

    def _next_candidate(self) -> Sequence | None:
        """The sequence admission tries next: preempted ones first, since they already waited once."""
        if self.preempted:
            return self.preempted[0]
        return self.waiting.peek()

    def _pop_candidate(self, seq: Sequence) -> None:
        if self.preempted and self.preempted[0] is seq:
            self.preempted.popleft()
        else:
            self.waiting.pop(seq)

    def held(self) -> list[Sequence]:
        """Sequences holding a slot this step; those already finished count as padding."""
        return list(self.running)

    def idle_wait(self) -> float | None:
        """Seconds until admission may open, for a rule that holds work back on purpose; None means it never
        does, so a step that schedules nothing while requests remain is a bug the engine reports."""
        return None

    @property
    def num_waiting(self) -> int:
        """Sequences not admitted yet (queued or preempted)."""
        return len(self.waiting) + len(self.preempted)

    def finish(self, seq: Sequence) -> None:
        """End `seq`: running, or preempted after sampling a token the host reads only now (a step
        overlapped with the next one: the engine learns of a stop one step late)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.preempted.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Give back what `seq` holds: its KV blocks and what the step feature holds for it."""
        self.bm.release(seq)
        self.features.release(seq)

    def recompute(self, seq: Sequence) -> None:
        """Send a running `seq` back to be recomputed from its tokens (a hybrid model's state absorbed a
        token that was corrected after the step launched: engine.py, overlapped steps)."""
        if seq.status is SequenceStatus.RUNNING:
            self._preempt(seq)

    def abort(self, seqs: list[Sequence]) -> None:
        doomed = {s.seq_id for s in seqs}
        for seq in seqs:
            if seq.block_tables:
                self._release(seq)
            seq.status = SequenceStatus.FINISHED
        self.waiting.remove(doomed)
        self.preempted = deque(s for s in self.preempted if s.seq_id not in doomed)
        self.running = [s for s in self.running if s.seq_id not in doomed]
