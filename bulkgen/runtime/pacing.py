"""How often the runtime asks storage about its batches: by the line and on change, not by the second.

Each storage request costs money on S3, so the runtime's periodic writes and reads follow the work:

- A runner writes its batch's progress (request_counts, usage, metrics) when it changed, at most once per
  PUBLISH_FLOOR_S, and then only once a PUBLISH_STEPS'th of the batch's lines settled since the last
  write, or PUBLISH_QUIET_S passed (a slow batch still shows its progress). A batch thus writes its
  progress about PUBLISH_STEPS times, plus once per PUBLISH_QUIET_S of its run at most, however many
  lines it has: per 1,000 lines of a 10k-line batch, one write. That is on storage that bills each request
  (S3: Store.billed_requests); on a local folder progress is written at every PUBLISH_FLOOR_S it moved. Status changes are not progress: they are
  written at once, by whoever makes them (bulkgen.batch.lifecycle through BatchRepo.update).
- A manager lists the active batches with a back-off: every Settings.scan_every_s (2 s) at first, twice
  as long after each listing that found nothing new, up to SCAN_IDLE_MAX_S; a batch created or cancelled
  through this process, a runner that stopped, or a failed listing starts over at the first interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PUBLISH_FLOOR_S = 2.0  # at most one progress write per this
PUBLISH_STEPS = 10  # else one per 1/10 of the batch's lines
PUBLISH_QUIET_S = 20.0  # or, with any progress, once per this
CONTROL_QUIET_S = 10.0  # without a progress write (which reads the record), the runner reads it this often
SCAN_IDLE_MAX_S = 60.0


@dataclass
class ProgressPacer:
    """When a runner writes progress: `due(settled, now)`, then `written(settled, now)` once it has."""

    total: int  # the batch's requests
    floor_s: float = PUBLISH_FLOOR_S
    steps: int = PUBLISH_STEPS
    quiet_s: float = PUBLISH_QUIET_S
    last_settled: int = 0
    last_at: float = field(default=float("-inf"))

    def due(self, settled: int, now: float) -> bool:
        moved = settled - self.last_settled
        if moved <= 0:
            return False
        since = now - self.last_at
        step = max(1, self.total // self.steps)
        return since >= self.quiet_s or (since >= self.floor_s and moved >= step)

    def written(self, settled: int, now: float) -> None:
        self.last_settled, self.last_at = settled, now


class Backoff:
    """An interval that doubles while nothing happens, up to `cap`, and starts over when something does."""

    def __init__(self, first: float, cap: float = SCAN_IDLE_MAX_S) -> None:
        self.first, self.cap = first, cap
        self.current = first

    def next(self) -> float:
        """The wait before the next look; the one after is twice as long (to the cap)."""
        wait, self.current = self.current, min(self.cap, self.current * 2)
        return wait

    def reset(self) -> None:
        self.current = self.first
