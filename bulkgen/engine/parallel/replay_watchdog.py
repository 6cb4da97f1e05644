"""A deadline on tensor-parallel steps whose collectives run inside a CUDA graph.

NCCL's watchdog bounds every collective ProcessGroupNCCL launches by the group's timeout (it tears the
process down when one passes), but a collective captured in a decode graph is launched by the graph's
replay, so nothing watches it: a rank lost during a replay would leave the other ranks' GPUs in that
collective, and their hosts in their next wait for the device, forever. So each step that replays a
graph records a CUDA event behind it, and a thread checks the oldest one still unfinished: once it is
older than the group's timeout, the watchdog does what NCCL does for its own collectives, logs and ends
the process. The runtime then sees one lost worker (its followers see rank 0's store go and exit), as
it does for a rank lost during an eager collective.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class Completion(Protocol):
    """What the watchdog waits for: a torch.cuda.Event recorded behind a step's work."""

    def query(self) -> bool: ...


class ReplayWatchdog:
    """Ends the process (or calls `on_timeout`) when a watched step has not finished `timeout_s` seconds
    after it was queued; checks every `poll_s` seconds from a daemon thread started with the first watch."""

    def __init__(
        self,
        timeout_s: float,
        on_timeout: Callable[[float], None] | None = None,
        poll_s: float = 1.0,
    ) -> None:
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.on_timeout = on_timeout or _tear_down
        self._pending: deque[tuple[float, Completion]] = deque()  # appended by the step, drained here
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, done: Completion) -> None:
        """Watch one step's work from now on; `done` reports when the device has finished it."""
        self._pending.append((time.monotonic(), done))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="bulkgen-replay-watchdog", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            pending = self._pending
            while pending and pending[0][1].query():
                pending.popleft()
            if pending and (waited := time.monotonic() - pending[0][0]) > self.timeout_s:
                self.on_timeout(waited)
                return


def _tear_down(waited: float) -> None:
    log.critical(
        "a tensor-parallel step replaying a CUDA graph has not finished after %.0f s: a rank is lost "
        "inside a captured collective, which NCCL's watchdog does not see; ending this process",
        waited,
    )
    logging.shutdown()
    os._exit(1)
