"""What crosses between the driver and a worker about one range of a batch: where it lies in the input
file (`RangeBounds`, with the assignment) and how it ended (`RangeOutcome`, in the worker's poll answer).
Both cross Ray's actor boundary, so they hold plain values only."""

from __future__ import annotations

from dataclasses import dataclass, field

from bulkgen.runtime.parts import Tally


@dataclass(frozen=True)
class RangeBounds:
    """A range of consecutive requests of one batch, three ways at once."""

    batch_id: str
    lo: int  # index positions [lo, hi) of the batch's LineIndex: how the runner counts what is done
    hi: int
    first_line: int  # input lines first..last: the name of the range's part (layout.part)
    last_line: int
    start: int  # bytes [start, end) of the input file: what the worker reads
    end: int

    @property
    def key(self) -> tuple[str, int, int]:
        return self.batch_id, self.lo, self.hi

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclass
class RangeOutcome:
    """A range a worker is done with: its part is stored (`tally` counts it), or, with `error`, it was not
    run at all and goes back to the queue."""

    bounds: RangeBounds
    tally: Tally = field(default_factory=Tally)  # request_counts and usage of its part
    requests: list[dict] = field(
        default_factory=list
    )  # per engine request: its metrics (BatchMetrics.add_request)
    error: str | None = None  # why the worker could not run it (it could not read the range)
    storage_down: bool = (
        False  # the error was storage not answering: no fault of the requests, no attempt used
    )
    health: dict | None = None  # its answers' output health (OutputHealth.to_state())
