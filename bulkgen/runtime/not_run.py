"""The error lines of requests a stopped batch never ran, written as finalize merges its parts.

A cancelled or expired batch's error file holds a line for each request without a result (`not_run_line`:
`response` null, `error` {batch_cancelled | batch_expired}). Those requests are the lines between the parts
finalize merges, so `parts.merge_parts` asks for them gap by gap, in input order, and they go into the error
file beside the parts' error lines in one streamed pass. Each needs only its custom_id, read from the input
file through a window of WINDOW bytes: one ranged GET per window, whatever the number of gaps in it, and
memory of one window, so cancelling a batch of ten million lines early costs about input size / WINDOW
GETs and no PUT beyond the error file's own.
"""

from __future__ import annotations

from typing import BinaryIO

import numpy as np

from bulkgen.batch.outputlines import json_line, not_run_line
from bulkgen.batch.requests import custom_id_of
from bulkgen.runtime.lineindex import LineIndex
from bulkgen.store import Store

WINDOW = 8 * 1024 * 1024  # input bytes read at once (a longer line is read whole)


class NotRun:
    """Writes `code`'s error line for each request of `index` on the input lines `gap` is asked for."""

    def __init__(
        self, store: Store, input_key: str, index: LineIndex, code: str, window: int = WINDOW
    ) -> None:
        self.store, self.input_key, self.index, self.code = store, input_key, index, code
        self.window = window
        self._at = 0  # bytes [_at, _at + len(_data)) of the input are held
        self._data = b""

    def gap(self, after_line: int, before_line: int | None, errors: BinaryIO) -> int:
        """The requests on input lines after `after_line` and before `before_line` (None: to the end):
        their error lines written to `errors`; returns how many."""
        lines = self.index.lines
        lo = int(np.searchsorted(lines, after_line, side="right"))
        hi = len(lines) if before_line is None else int(np.searchsorted(lines, before_line, side="left"))
        for i in range(lo, hi):
            custom_id = custom_id_of(self._line(i))
            errors.write(json_line(not_run_line(custom_id, self.code)))
        return max(0, hi - lo)

    def _line(self, i: int) -> bytes:
        start = int(self.index.starts[i])
        end = start + int(self.index.lengths[i])
        if start < self._at or end > self._at + len(self._data):
            last = int(self.index.starts[-1]) + int(self.index.lengths[-1])  # the last request's end
            self._at, self._data = (
                start,
                self.store.read_range(self.input_key, start, max(end, min(last, start + self.window))),
            )
        return self._data[start - self._at : end - self._at]
