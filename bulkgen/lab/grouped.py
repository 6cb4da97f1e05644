"""Static and dynamic batching on the real engine: the admission rules continuous batching is measured
against (`bulkgen bench`), never used to serve.

static: admit a group of up to max_num_seqs waiting sequences only when the last group is done, and hold
every member's slot until the slowest finishes (a finished member's slot is padding). Its prompts count as
padded to the group's longest, the cost a padded (not packed) prefill would pay.
dynamic: like static, but a group starts only once max_num_seqs are waiting or the oldest has waited
max_queue_delay seconds.
"""

from __future__ import annotations

import time
from collections import deque
from functools import partial

from bulkgen.engine.config import EngineConfig
from bulkgen.engine.engine import SchedulerFactory
from bulkgen.engine.kv.block_manager import BlockManager
from bulkgen.engine.scheduler import Scheduler
from bulkgen.engine.sequence import Sequence, SequenceStatus
from bulkgen.engine.step_features import NO_FEATURE, StepFeature

POLICIES = ("continuous", "static", "dynamic")
DEFAULT_MAX_QUEUE_DELAY = 0.05


class StaticScheduler(Scheduler):
    """Admits whole groups; a group's members hold their slots until every one has finished."""

    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, features: StepFeature = NO_FEATURE
    ) -> None:
        super().__init__(config, block_manager, features)
        self.group: list[Sequence] = []
        self.group_pending: deque[Sequence] = deque()  # members not admitted yet

    def _admission_open(self) -> bool:
        if self.group_pending or self.preempted:
            return True
        if any(s.status is not SequenceStatus.FINISHED for s in self.group):
            return False
        self.group = []
        if self.waiting and self._group_ready():
            self._start_group()
        return True

    def _group_ready(self) -> bool:
        return True

    def _start_group(self) -> None:
        members = []
        while len(members) < self.config.max_num_seqs and (seq := self.waiting.peek()) is not None:
            self.waiting.pop(seq)
            members.append(seq)
        self.group = list(members)
        self.group_pending = deque(members)
        longest = max(s.num_prompt_tokens for s in members)
        self.prefill_padding_tokens += sum(longest - s.num_prompt_tokens for s in members)

    def _next_candidate(self) -> Sequence | None:
        if self.preempted:
            return self.preempted[0]
        return self.group_pending[0] if self.group_pending else None

    def _pop_candidate(self, seq: Sequence) -> None:
        if self.preempted and self.preempted[0] is seq:
            self.preempted.popleft()
        else:
            self.group_pending.popleft()

    def _other_candidate(self, accept) -> Sequence | None:
        """A group runs in its order: a member whose adapter has no slot yet waits for one."""
        return None

    def held(self) -> list[Sequence]:
        return list(self.group)

    @property
    def num_waiting(self) -> int:
        return super().num_waiting + len(self.group_pending)

    def abort(self, seqs: list[Sequence]) -> None:
        super().abort(seqs)
        doomed = {s.seq_id for s in seqs}
        self.group_pending = deque(s for s in self.group_pending if s.seq_id not in doomed)


class DynamicScheduler(StaticScheduler):
    """Static groups that wait, up to `max_queue_delay` seconds, for max_num_seqs sequences to fill them."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        features: StepFeature = NO_FEATURE,
        max_queue_delay: float = DEFAULT_MAX_QUEUE_DELAY,
    ) -> None:
        super().__init__(config, block_manager, features)
        self.max_queue_delay = max_queue_delay

    def _group_ready(self) -> bool:
        return len(self.waiting) >= self.config.max_num_seqs or self._oldest_wait() >= self.max_queue_delay

    def _oldest_wait(self) -> float:
        return time.time() - min(s.request.metrics.arrival_time for s in self.waiting)

    def idle_wait(self) -> float | None:
        if self.running or self.group_pending or not self.waiting:
            return 0.0
        return max(0.0, self.max_queue_delay - self._oldest_wait())


def scheduler_for(policy: str, max_queue_delay: float = DEFAULT_MAX_QUEUE_DELAY) -> SchedulerFactory:
    """The engine's `scheduler` argument for a policy named on the command line."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if (
        isinstance(max_queue_delay, bool)
        or not isinstance(max_queue_delay, int | float)
        or max_queue_delay < 0
    ):
        raise ValueError(f"max_queue_delay must be a number >= 0, got {max_queue_delay!r}")
    if policy == "dynamic":
        return partial(DynamicScheduler, max_queue_delay=max_queue_delay)
    return StaticScheduler if policy == "static" else Scheduler
