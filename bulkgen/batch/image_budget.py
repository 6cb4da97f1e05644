"""A worker's image memory budget (`--image-memory-mb`): the bytes of images being decoded and processed, and of
the processor's pixel tensors not yet freed, that one worker holds at once.

Each line's images are costed from their headers before any pixel is decoded (images.decoded_cost: width x
height x what a pixel costs while it is decoded and processed), and the line takes that much of the budget
before its decoding starts: a line that would not fit waits until others give theirs back, and a line whose
images alone cost more than the whole budget is refused (its 400). Once the line's images are processed its
hold shrinks to what its pixel tensors really take, and that part is given back when the tensors are freed
(the engine drops them when the request ends), so the count follows the memory, not a guess of when it
goes. The budget counts bytes; it allocates nothing.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable

# a wait collects garbage this often: tensors of an ended request that a reference cycle still holds are
# otherwise freed only when the collector next runs, and the wait may be what keeps it from running
_COLLECT_EVERY_S = 1.0
TRIM_AFTER_BYTES = 64 << 20  # a line whose images cost this much trims the C heap once processed (heap_trim)


class ImageBudget:
    """Bytes a worker may hold in decoded images and pixel tensors: `total`, of which `used` are held now,
    and `peak`, the most ever held at once (what the tests assert)."""

    def __init__(self, total: int):
        self.total = total
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()

    def fits(self, cost: int) -> bool:
        """Whether a hold of `cost` can ever be granted (no more than the whole budget)."""
        return cost <= self.total

    def acquire(self, cost: int, stop: Callable[[], bool] = lambda: False) -> Hold | None:
        """Take `cost` bytes, waiting while they would not fit beside what is held; None if `stop()` turns
        true while waiting. A cost over the whole budget is the caller's to refuse first (`fits`): granted
        alone, it never waits on others forever."""
        collect_at = time.monotonic() + _COLLECT_EVERY_S
        while True:
            with self._cond:
                if cost == 0 or self.used == 0 or self.used + cost <= self.total:
                    self._take(cost)
                    return Hold(self, cost)
                if stop():
                    return None
                self._cond.wait(0.25)
            if time.monotonic() >= collect_at:
                gc.collect()  # outside the lock: finalizers of tensors only a cycle kept give their bytes back
                collect_at = time.monotonic() + _COLLECT_EVERY_S

    def try_acquire(self, cost: int) -> Hold | None:
        """Take `cost` bytes if they fit now, else None (no wait)."""
        with self._cond:
            if cost and self.used + cost > self.total:
                return None
            self._take(cost)
            return Hold(self, cost)

    def add(self, cost: int) -> Hold:
        """Count `cost` bytes already allocated (a line's pixel tensors, made under its decoding hold): never
        waits, never refused."""
        with self._cond:
            self._take(cost)
        return Hold(self, cost)

    def _take(self, cost: int) -> None:
        self.used += cost
        self.peak = max(self.peak, self.used)

    def _give(self, cost: int) -> None:
        with self._cond:
            self.used -= cost
            self._cond.notify_all()


class Hold:
    """Bytes taken from a budget; `release` gives them back (once, however often it is called)."""

    def __init__(self, budget: ImageBudget, cost: int):
        self.budget, self.cost = budget, cost
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            cost, self.cost = self.cost, 0
        if cost:
            self.budget._give(cost)

    def until_freed(self, owner: object) -> Hold:
        """Give the bytes back when `owner` (the tensors they count) is garbage, whichever path drops it."""
        weakref.finalize(owner, self.release)
        return self
