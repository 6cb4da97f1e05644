"""The engine's waiting queue: which sequence not yet admitted goes next.

Sequences are grouped by their request's tag (the runtime tags every request with its batch id).
Between tags the choice is fair: the tag admitted the fewest tokens of work (prompt plus output
budget) so far goes next. A tag that arrives, or comes back after its waiting list emptied, starts at
the least count of the tags already waiting, so time spent away earns it no credit. A small batch that
joins behind thousands of waiting requests of another therefore starts at the next free slot instead
of after all of them. Within a tag the engine's admission order applies (longest first by default, so
long requests start early instead of straggling). With a single tag (`Engine.generate`, one batch)
this is exactly the admission order.

Bounded: only tags with waiting sequences are remembered.

The runtime's fair shares between tenants (bulkgen.runtime.fairshare) apply the same rule (least served
goes next; a newcomer joins at the least of those waiting) to a different question, and are written apart
on purpose: this shares one engine's admissions between the batches it holds, equally, counting tokens as
sequences are admitted, and knows no tenants, weights, ranges or refunds; that shares every worker between
tenants by weight, charging estimates and correcting them when ranges end. The engine sits below the
runtime (the layers contract) and must not learn the runtime's words, and the runtime's policy is not the
engine's: one class for both would carry each side's half as options the other never sets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from bulkgen.engine.sequence import Sequence


class WaitingQueue:
    def __init__(self, admission: str) -> None:
        self.admission = admission
        self._tags: dict[str, list[Sequence]] = {}  # per tag, sorted so its next to admit is last
        self._unsorted: set[str] = set()
        self._served: dict[str, float] = {}  # tokens of work admitted per tag (relative: see _join)
        self._turn: dict[str, int] = {}  # when each tag was last admitted: ties go to the longest waiting
        self._clock = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self._tags.values():
            yield from queue

    def add(self, seq: Sequence) -> None:
        tag = seq.request.tag
        if tag not in self._tags:
            self._join(tag)
        self._tags[tag].append(seq)
        self._unsorted.add(tag)
        self._count += 1

    def peek(self, accept: Callable[[Sequence], bool] | None = None) -> Sequence | None:
        """The next sequence to admit: of the tag with the least work admitted, its first in admission order.
        With `accept`, the first sequence it accepts in that order (tags by fairness, then admission order
        within each), None if there is none: a scan, which the scheduler needs only when the sequence next
        in line cannot run yet (its LoRA adapter would exceed the step's adapters)."""
        if not self._tags:
            return None
        fair = sorted(self._tags, key=self._fairness) if accept else [min(self._tags, key=self._fairness)]
        for tag in fair:
            if tag in self._unsorted:
                self._tags[tag].sort(key=self._order_key)
                self._unsorted.discard(tag)
            if accept is None:
                return self._tags[tag][-1]
            found = next((s for s in reversed(self._tags[tag]) if accept(s)), None)
            if found is not None:
                return found
        return None

    def _fairness(self, tag: str) -> tuple[float, int]:
        return self._served[tag], self._turn.get(tag, -1)

    def pop(self, seq: Sequence) -> None:
        """Admit `seq`, the sequence `peek` returned: its tag is charged its work."""
        tag = seq.request.tag
        queue = self._tags[tag]
        if queue[-1] is seq:
            queue.pop()
        else:  # one `peek(accept)` chose from further back
            queue.remove(seq)
        self._count -= 1
        self._served[tag] += seq.total_work
        self._turn[tag] = self._clock
        self._clock += 1
        if not queue:
            self._leave(tag)

    def remove(self, seq_ids: set[int]) -> None:
        for tag in list(self._tags):
            kept = [s for s in self._tags[tag] if s.seq_id not in seq_ids]
            self._count -= len(self._tags[tag]) - len(kept)
            self._tags[tag] = kept
            if not kept:
                self._leave(tag)

    def _join(self, tag: str) -> None:
        self._served[tag] = min(self._served.values(), default=0.0)
        self._tags[tag] = []

    def _leave(self, tag: str) -> None:
        # a tag leaves at most one request's work ahead of the others (it went only when it was least)
        del self._tags[tag], self._served[tag]
        self._turn.pop(tag, None)
        self._unsorted.discard(tag)

    def _order_key(self, s: Sequence) -> tuple:
        if self.admission == "longest_first":
            return s.total_work, -s.request.order, -s.index
        if self.admission == "shortest_first":
            return -s.total_work, -s.request.order, -s.index
        return -s.request.order, -s.index
