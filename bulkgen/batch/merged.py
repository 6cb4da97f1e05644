"""One result per request across a batch and its retries (`bulkgen results BATCH --merged`).

The batches of a retry chain (bulkgen.batch.retry) each write their output and error files in their own
input order, and a retry's input is a subsequence of the original's, so one streamed pass over the
original input beside every batch's two files joins them in bounded memory: for each custom_id the
newest success wins; a request that never succeeded keeps its newest error; one that got no result in
any batch (a batch that failed while running) gets a `no_result` error line, so each custom_id is
written exactly once, in the original input order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from bulkgen.batch.outputlines import envelope, json_line
from bulkgen.batch.requests import custom_id_of


@dataclass
class MergeCounts:
    succeeded: int = 0
    failed: int = 0


class ResultCursor:
    """A result file read beside its input: output and error files list their lines in input order
    (runtime/parts.merge_parts), so each input line takes the file's next line or none. Raw bytes are
    kept: a merge copies lines as they were written."""

    def __init__(self, lines: Iterable[bytes]) -> None:
        self._lines = (raw for raw in lines if raw.strip())
        self._next()

    def _next(self) -> None:
        self.raw = next(self._lines, None)
        self.custom_id = None if self.raw is None else custom_id_of(self.raw)

    def take(self, custom_id: str) -> bytes | None:
        if self.custom_id != custom_id:
            return None
        found = self.raw
        self._next()
        return found


def requests(input_lines: Iterable[bytes]) -> Iterator[tuple[bytes, str]]:
    """(line, custom_id) of each request of an input file that ran (validated: every line has one)."""
    for raw in input_lines:
        if raw.strip():
            yield raw, custom_id_of(raw)


def check_all_taken(cursors: Iterable[ResultCursor]) -> None:
    """A line left over was never met in the walk: not in the input, or not in its order."""
    for cursor in cursors:
        if cursor.raw is not None:
            raise ValueError(
                f"custom_id {cursor.custom_id!r} of a result file is not in the input, or not in "
                "its order; its results cannot be matched to the input"
            )


def merge_chain(
    input_lines: Iterable[bytes],
    chain: list[tuple[Iterable[bytes], Iterable[bytes]]],
    output: BinaryIO,
    errors: BinaryIO,
) -> MergeCounts:
    """`chain`: (output lines, error lines) of each batch, the original first, its newest retry last."""
    files = [(ResultCursor(out), ResultCursor(err)) for out, err in chain]
    counts = MergeCounts()
    for _, custom_id in requests(input_lines):
        success = error = None
        for done, failed in files:  # oldest to newest: a later find replaces an earlier one
            success = done.take(custom_id) or success
            error = failed.take(custom_id) or error
        if success is not None:
            output.write(success.rstrip(b"\r\n") + b"\n")
            counts.succeeded += 1
        else:
            errors.write(error.rstrip(b"\r\n") + b"\n" if error is not None else _no_result(custom_id))
            counts.failed += 1
    check_all_taken(cursor for pair in files for cursor in pair)
    return counts


def _no_result(custom_id: str) -> bytes:
    return json_line(
        envelope(
            custom_id,
            None,
            {
                "code": "no_result",
                "message": "No batch of the retry chain "
                "produced a result for this request (a batch failed while running).",
            },
        )
    )
