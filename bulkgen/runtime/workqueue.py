"""The service's work queue: line ranges of every running batch, handed to workers as they have room.

Workers pull; nothing is pushed in fixed chunks. `take(worker, want)` answers with ranges totalling
about `want` requests, chosen so that:
- a batch that got no work for `fair_share_after_s` is served next, whatever the rules below say, so
  no batch ever starves;
- a worker gets only batches of models of its rank count (`--tensor-parallel`: runtime/pool.py);
- otherwise the worker's loaded model is kept where there is a choice, and tenants share the workers
  by weight: the tenant whose work so far, over its weight, is least goes next (weighted fair queueing
  over tokens of work: fairshare.py);
- within a tenant, batches go by priority (`metadata.bulkgen_priority`: high, normal, low), then in
  order (FIFO by creation, or earliest deadline first);
- within a batch, the longest work goes first, so long requests start early instead of straggling;
- ranges whose requests share a leading prompt go to the worker that already served that prefix,
  where its KV prefix cache still holds it;
- at the tail (fewer pending requests than workers could hold) ranges are split, so every worker
  gets a share and none is left with a long queue while the others idle.
A range that was in flight on a worker that died comes back with one more attempt; after a second
failure it is halved, so a request that kills its worker is isolated and, alone, given up on.

Every call costs O(log n) in the ranges and batches queued (plus the tenants with work, and the batches
a take excludes), never O(n): the queue keeps running counts of pending requests (per rank class, per
batch) and of backlogged tenants; each batch keeps its ranges as a short sorted front (the affinity
look-ahead) over a heap; batches are chosen from heaps per rank class and model (_Choice). A range split
at the tail leaves its remainder where its work per request sorts it. The prefix-affinity map keeps the
most recently served AFFINITY_ENTRIES prefixes.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from bulkgen.runtime.fairshare import FairShare
from bulkgen.runtime.lineindex import LineIndex
from bulkgen.runtime.ranges import RangeBounds

MAX_ATTEMPTS = 3
AFFINITY_LOOKAHEAD = 16
AFFINITY_ENTRIES = 1 << 16  # prefixes whose last worker is remembered (least recently served go first)


@dataclass
class QueuedBatch:
    """A running batch as the queue holds it: what orders its ranges, and what a worker needs to run them
    (small; sent with every assignment)."""

    batch_id: str
    input_key: str
    endpoint: str
    model: str  # the name clients use
    model_path: str  # where it is: two drivers may serve one name from different places
    order_key: float  # created_at (fifo) or expires_at (deadline): lower goes first
    store: dict  # the batch's storage (`Store.open_args()`): workers may serve several services
    tenant: str = "default"  # whose share of the workers the batch's work counts against
    priority: int = 1  # among the tenant's batches, lower goes first (0 high, 1 normal, 2 low)
    loras: dict[str, str] = field(default_factory=dict)  # the model's LoRA adapters its lines may name:
    # name -> folder or URL (workers load one when a line first names it)
    ranks: int = 1  # the model's ranks per worker (--tensor-parallel): only workers of that count run it
    reasoning_parser: str | None = None  # --reasoning-parser for the model; None: what its template teaches
    template_options: dict = field(default_factory=dict)  # --chat-template-kwargs for the model: chat lines'
    # template options where they set none
    tool_parser: str | None = None  # --tool-parser for the model; None: what its template teaches
    thinking_budget: int | None = None  # --thinking-token-budget for the model: where a line sets none
    # the S3 endpoint of its service's s3:// adapters (--endpoint-url): a worker serving several services
    # fetches each batch's from its own service's endpoint, not from whichever service loaded a model last
    endpoint_url: str | None = None

    @property
    def model_key(self) -> str:
        return model_key(self.model, self.model_path)


def model_key(name: str | None, path: str | None) -> str | None:
    """What a worker has loaded: a name alone is not enough when drivers share workers."""
    return f"{name}@{path}" if name else None


@dataclass
class QueuedRange:
    """A range of a batch waiting in the queue (or in flight on a worker, until it is done)."""

    batch: QueuedBatch
    bounds: RangeBounds
    work: int  # estimated tokens of work (prompt and output): what a tenant's share is charged
    prefix: int  # key of its first request's leading prompt (lineindex): prefix cache affinity
    attempts: int = 0  # workers that died holding it

    @property
    def size(self) -> int:
        return self.bounds.size

    @property
    def key(self) -> tuple[str, int, int]:
        return self.bounds.key


def _order_entry(pending: _Pending) -> tuple[tuple[int, float, str], int, str]:
    b = pending.batch
    return (b.priority, b.order_key, b.batch_id), pending.live, b.batch_id


def cut_range(batch: QueuedBatch, index: LineIndex, lo: int, hi: int, attempts: int = 0) -> QueuedRange:
    bounds = RangeBounds(
        batch.batch_id,
        lo,
        hi,
        int(index.lines[lo]),
        int(index.lines[hi - 1]),
        int(index.starts[lo]),
        int(index.ends[hi - 1]),
    )
    return QueuedRange(batch, bounds, int(index.work[lo:hi].sum()), int(index.prefix[lo]), attempts)


def make_ranges(batch: QueuedBatch, index: LineIndex, todo: np.ndarray, size: int) -> list[QueuedRange]:
    """Ranges of at most `size` consecutive requests over the positions where `todo` is True."""
    ranges = []
    for lo, hi in true_runs(todo):
        for start in range(lo, hi, size):
            ranges.append(cut_range(batch, index, start, min(hi, start + size)))
    return ranges


def true_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[lo, hi) runs where `mask` is True."""
    padded = np.concatenate(([False], mask.astype(bool), [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


class _Ordered:
    """A batch's pending ranges, longest work per request first (then by first line): the first
    AFFINITY_LOOKAHEAD in a sorted list (what `_affine` looks through), the rest in a heap whose top
    refills it. Adding or removing a range is O(log n); `requests` is their running total."""

    def __init__(self) -> None:
        self.front: list[tuple[tuple[float, int, int], QueuedRange]] = []  # sorted; <= every item in rest
        self.rest: list[tuple[tuple[float, int, int], QueuedRange]] = []  # a heap; empty unless front is full
        self.requests = 0
        self._seq = itertools.count()  # keys are unique, so ranges themselves are never compared

    def __len__(self) -> int:
        return len(self.front) + len(self.rest)

    def add(self, r: QueuedRange) -> None:
        item = ((-r.work / r.size, r.bounds.lo, next(self._seq)), r)
        self.requests += r.size
        if len(self.front) < AFFINITY_LOOKAHEAD or item[0] < self.front[-1][0]:
            bisect.insort(self.front, item)
            if len(self.front) > AFFINITY_LOOKAHEAD:
                heapq.heappush(self.rest, self.front.pop())
        else:
            heapq.heappush(self.rest, item)

    def window(self) -> list[QueuedRange]:
        return [r for _, r in self.front]

    def first(self) -> QueuedRange:
        return self.front[0][1]

    def pop(self, i: int) -> QueuedRange:
        _, r = self.front.pop(i)
        if self.rest:  # the heap's top is >= every item left in front: appending keeps it sorted
            self.front.append(heapq.heappop(self.rest))
        self.requests -= r.size
        return r


@dataclass
class _Pending:
    batch: QueuedBatch
    index: LineIndex
    last_served: float  # on the queue's clock
    ranges: _Ordered = field(default_factory=_Ordered)
    seq: int = 0  # when it was queued: ties in last_served go to the first queued
    live: int = 0  # bumped each time it gets ranges again: older entries of it in _Choice heaps are stale

    def levels(self) -> tuple[tuple, tuple]:
        """The _Choice levels it is chosen in: its rank class, and its rank class and model."""
        return ("ranks", self.batch.ranks), ("model", self.batch.ranks, self.batch.model_key)


class _Choice:
    """The batches with ranges of one level (a rank class, or a rank class and model), kept so a take
    chooses among them in O(log n): the one least recently served (a heap; the starving rule), and
    per tenant the first by (priority, order) (a heap each); `tenants` counts each tenant's batches.
    Entries go stale (the batch was served, emptied or removed) and are dropped when they reach a top,
    or all at once when stale ones outnumber the live."""

    def __init__(self) -> None:
        self.served: list[tuple[float, int, int, str]] = []  # (last_served, seq, live, batch id)
        self.order: dict[str, list[tuple[tuple[int, float, str], int, str]]] = {}  # tenant -> heap
        self.tenants: dict[str, int] = {}  # tenant -> its batches with ranges at this level
        self.batches = 0


class WorkQueue:
    """`clock` (monotonic seconds) times how long a batch went unserved; tests pass a fake one."""

    def __init__(
        self,
        num_workers: Callable[[int], int],
        fair_share_after_s: float = 30.0,
        weights: Callable[[], dict[str, float]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self._num_workers = num_workers  # rank count -> the pool's current workers of that class
        self.fair_share_after_s = fair_share_after_s
        self.fair = FairShare(weights)  # tenant -> weight; missing tenants weigh 1
        self._batches: dict[str, _Pending] = {}
        self._affinity: OrderedDict[int, int] = OrderedDict()  # prefix key -> worker that served it last
        self._requests: dict[int, int] = {}  # rank count -> pending requests of its batches
        self._backlog: dict[str, int] = {}  # tenant -> its batches with pending ranges (none: absent)
        self._waiting = 0  # batches with pending ranges
        self._choices: dict[tuple, _Choice] = {}  # level -> its batches with ranges (_Pending.levels)
        self._seq = itertools.count(1)  # batch seq and live numbers: never reused
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def on_work(self, listener: Callable[[], None]) -> None:
        """Call `listener` (quick, non-blocking: it runs under the queue's lock) whenever ranges are queued,
        so a dispatcher waiting on a worker hands them out at once instead of at its next poll."""
        self._listeners.append(listener)

    def _queued(self) -> None:
        for listener in self._listeners:
            listener()

    def add_batch(self, batch: QueuedBatch, index: LineIndex, ranges: list[QueuedRange]) -> None:
        with self._lock:
            self._join(batch.tenant)
            pending = self._batches.get(batch.batch_id)
            if pending is None:
                pending = self._batches[batch.batch_id] = _Pending(
                    batch, index, self.clock(), seq=next(self._seq)
                )
            self._add(pending, ranges)
            self._queued()

    def remove_batch(self, batch_id: str) -> None:
        """Drop the batch's pending ranges (cancelled, expired, lease lost, or done)."""
        with self._lock:
            pending = self._batches.pop(batch_id, None)
            if pending is not None:
                self._count(pending, -pending.ranges.requests, had=bool(pending.ranges), has=False)

    def pending_requests(self) -> int:
        with self._lock:
            return sum(self._requests.values())

    def batches_waiting(self) -> int:
        with self._lock:
            return self._waiting

    def take(
        self,
        worker: int,
        want: int,
        model: str | None,
        idle: bool,
        exclude: set[str] | frozenset[str] = frozenset(),
        ranks: int = 1,
    ) -> list[QueuedRange]:
        """Ranges for `worker` (a worker of `ranks` ranks), about `want` requests, of `model` (a
        `model_key`; any model of its rank count when the worker is idle), of none of the batches in
        `exclude`."""
        if want < 1:
            return []
        with self._lock:
            pending = self._next_batch(model, idle, exclude, ranks)
            if pending is None:
                return []
            pending.last_served = self.clock()
            self._push_served(pending)
            share = self._tail_share(ranks)
            tail = share < pending.ranges.first().size  # split ranges only where they would cause stragglers
            want = min(want, share)
            taken: list[QueuedRange] = []
            count = 0
            while pending.ranges and count < want:
                taken.append(self._pop(pending, worker, want - count if tail else None))
                count += taken[-1].size
            self._count(pending, -count, had=True, has=bool(pending.ranges))
            self.fair.charge(pending.batch.tenant, sum(r.work for r in taken))
            return taken

    def settle(self, r: QueuedRange, tokens: int) -> None:
        """`r` finished having used `tokens` (prompt plus output): its tenant's charge becomes that."""
        with self._lock:
            self.fair.charge(r.batch.tenant, tokens - r.work)

    def shares(self) -> dict[str, dict]:
        """Per tenant: weight and share of the work handed out so far (for the dashboard)."""
        with self._lock:
            return self.fair.shares()

    def put_back(self, ranges: list[QueuedRange], count: bool = True) -> list[QueuedRange]:
        """Ranges lost with a dead worker go back, one attempt older; returns those given up on.
        count=False: the request was not at fault (storage did not answer), so it is not an attempt."""
        given_up = []
        with self._lock:
            for r in ranges:
                self.fair.charge(r.batch.tenant, -r.work)  # not done: refunded, charged again when retaken
                pending = self._batches.get(r.batch.batch_id)
                if pending is None:
                    continue  # the batch stopped meanwhile
                self._join(r.batch.tenant)
                attempts = r.attempts + int(count)
                if attempts >= MAX_ATTEMPTS and r.size == 1:
                    given_up.append(r)
                elif attempts >= 2 and r.size > 1:  # suspect a poison request: halve to isolate it
                    mid = (r.bounds.lo + r.bounds.hi) // 2
                    self._add(
                        pending,
                        [
                            cut_range(r.batch, pending.index, r.bounds.lo, mid, attempts),
                            cut_range(r.batch, pending.index, mid, r.bounds.hi, attempts),
                        ],
                    )
                else:
                    lo, hi = r.bounds.lo, r.bounds.hi
                    self._add(pending, [cut_range(r.batch, pending.index, lo, hi, attempts)])
            self._queued()
        return given_up

    # -- choices ---------------------------------------------------------------------------------
    def _next_batch(
        self, model: str | None, idle: bool, exclude: set[str] | frozenset[str], ranks: int
    ) -> _Pending | None:
        """Among the batches with ranges of the worker's rank class (of its model unless it is idle), not
        in `exclude`: the one that waited longest if it waited fair_share_after_s, else the worker's own
        model's where there is a choice (no reload), the tenant of least share, its first batch by
        priority and order. O(log n) per call (plus the tenants of the level, and `exclude`)."""
        level = ("ranks", ranks) if idle else ("model", ranks, model)
        longest = self._first_served(level, exclude)
        if longest is None:
            return None
        if self.clock() - longest.last_served >= self.fair_share_after_s:
            return longest  # the one that waited longest, whatever its share, priority and order say
        own = self._first_by_share(("model", ranks, model), exclude) if model is not None else None
        return own or self._first_by_share(level, exclude)

    def _valid(self, batch_id: str, live: int) -> _Pending | None:
        pending = self._batches.get(batch_id)
        return pending if pending is not None and pending.live == live and pending.ranges else None

    def _first_served(self, level: tuple, exclude: set[str] | frozenset[str]) -> _Pending | None:
        """The level's batch served least recently, not in `exclude`."""
        choice = self._choices.get(level)
        if choice is None:
            return None
        # an entry is stale once its batch was served again (a newer entry stands for it)
        return self._first_live(choice.served, exclude, lambda entry, p: p.last_served != entry[0])

    def _first_live(self, heap: list, exclude, stale=lambda entry, pending: False) -> _Pending | None:
        """The batch of `heap`'s first entry that is live, not stale and not in `exclude` (entries ending
        `(live, batch id)`): stale ones are dropped, excluded ones put back."""
        skipped, found = [], None
        while heap:
            entry = heap[0]
            pending = self._valid(entry[-1], entry[-2])
            if pending is None or stale(entry, pending):
                heapq.heappop(heap)
            elif entry[-1] in exclude:
                skipped.append(heapq.heappop(heap))
            else:
                found = pending
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def _first_by_share(self, level: tuple, exclude: set[str] | frozenset[str]) -> _Pending | None:
        """The level's tenant of least share (among those with a batch not in `exclude`), its first
        batch by priority and order."""
        choice = self._choices.get(level)
        if choice is None:
            return None
        tenants = set(choice.tenants)
        while tenants:
            tenant = self.fair.pick(tenants)
            found = self._first_live(choice.order.get(tenant, []), exclude)
            if found is not None:
                return found
            tenants.discard(tenant)
        return None

    def _push_served(self, pending: _Pending) -> None:
        if not pending.ranges:
            return
        entry = (pending.last_served, pending.seq, pending.live, pending.batch.batch_id)
        for level in pending.levels():
            choice = self._choices[level]
            heapq.heappush(choice.served, entry)
            if len(choice.served) > 2 * choice.batches + 32:
                self._rebuild(level, choice)

    def _rebuild(self, level: tuple, choice: _Choice) -> None:
        """Drop every stale entry of the level (amortized: it runs once its heaps are twice what is live)."""
        live = [p for p in self._batches.values() if p.ranges and level in p.levels()]
        choice.served = [(p.last_served, p.seq, p.live, p.batch.batch_id) for p in live]
        heapq.heapify(choice.served)
        choice.order = {}
        for p in live:
            choice.order.setdefault(p.batch.tenant, []).append(_order_entry(p))
        for heap in choice.order.values():
            heapq.heapify(heap)

    def _listed(self, pending: _Pending, has: bool) -> None:
        """The batch got ranges (`has`) or lost its last: its levels' counts and entries follow."""
        tenant = pending.batch.tenant
        if has:
            pending.live = next(self._seq)
        for level in pending.levels():
            choice = self._choices.setdefault(level, _Choice())
            choice.batches += 1 if has else -1
            left = choice.tenants.get(tenant, 0) + (1 if has else -1)
            if left:
                choice.tenants[tenant] = left
            else:
                choice.tenants.pop(tenant, None)
            if has:
                heapq.heappush(choice.order.setdefault(tenant, []), _order_entry(pending))
                heapq.heappush(
                    choice.served, (pending.last_served, pending.seq, pending.live, pending.batch.batch_id)
                )
                if len(choice.served) > 2 * choice.batches + 32:
                    self._rebuild(level, choice)

    def _join(self, tenant: str) -> None:
        """Before `tenant`'s work is queued: if it had none queued, it joins the fair share anew."""
        if tenant not in self._backlog:
            self.fair.join(tenant, self._backlog.keys())

    def _add(self, pending: _Pending, ranges: Iterable[QueuedRange]) -> None:
        had, before = bool(pending.ranges), pending.ranges.requests
        for r in ranges:
            pending.ranges.add(r)
        self._count(pending, pending.ranges.requests - before, had=had, has=bool(pending.ranges))

    def _count(self, pending: _Pending, requests: int, had: bool, has: bool) -> None:
        """Keep the running counts: `requests` more pending in the batch's class; the batch went from
        having ranges (`had`) to `has`."""
        ranks, tenant = pending.batch.ranks, pending.batch.tenant
        self._requests[ranks] = self._requests.get(ranks, 0) + requests
        if had != has:
            self._listed(pending, has)
            step = 1 if has else -1
            self._waiting += step
            left = self._backlog.get(tenant, 0) + step
            if left:
                self._backlog[tenant] = left
            else:
                self._backlog.pop(tenant, None)

    def _tail_share(self, ranks: int) -> int:
        """Requests one worker of `ranks` ranks should take now: all it wants, except at the tail, where
        its class's work is split among its class's workers."""
        pending = self._requests.get(ranks, 0)
        return max(1, math.ceil(pending / max(1, self._num_workers(ranks))))

    def _pop(self, pending: _Pending, worker: int, limit: int | None) -> QueuedRange:
        """The next range for `worker`, at most `limit` requests of it (the rest stays queued). The
        caller keeps the running counts (`_count`) for what it took."""
        r = pending.ranges.pop(self._affine(pending, worker))
        if limit is not None and r.size > limit:  # keep the remainder queued
            lo, hi = r.bounds.lo, r.bounds.hi
            pending.ranges.add(cut_range(r.batch, pending.index, lo + limit, hi, r.attempts))
            r = cut_range(r.batch, pending.index, lo, lo + limit, r.attempts)
        if r.prefix:
            self._affinity[r.prefix] = worker
            self._affinity.move_to_end(r.prefix)
            if len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        return r

    def _affine(self, pending: _Pending, worker: int) -> int:
        """Among the next few longest ranges: one whose prefix this worker holds, else one no other
        worker holds, else the longest."""
        window = pending.ranges.window()
        for i, r in enumerate(window):
            if r.prefix and self._affinity.get(r.prefix) == worker:
                return i
        for i, r in enumerate(window):
            if not r.prefix or r.prefix not in self._affinity:
                return i
        return 0
