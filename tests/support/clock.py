"""A clock a test moves by hand, for the parts that take one (`clock=`): leases, claims, the work queue.

clock = FakeClock()                 # starts at the real wall time, so stored expiry times compare
lease = Lease(store, "b", "me", ttl_s=30, clock=clock)
clock.advance(31)                   # the lease has lapsed, without waiting 31 s
"""

from __future__ import annotations

import threading
import time


class FakeClock:
    """Seconds that pass only when `advance` says so; callable like time.time / time.monotonic."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds
