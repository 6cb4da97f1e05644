"""What validating a file holds in the API process, per request: the custom_id table, the line index and the
work tally are machine-word arrays, not Python lists and dicts (issue 49: ~380 bytes a request before, 913 MB
at 1M lines; the goal is an API under 1 GB at 10M lines). Measured with tracemalloc, which counts Python's
and numpy's allocations alike, on the validation pass every door runs (runtime/validation.py's Checked)."""

from __future__ import annotations

import gc
import io
import json
import os
import tracemalloc

import pytest

from bulkgen.batch.validate import FirstLines, Validator, _digest, validate_stream
from bulkgen.runtime.validation import Checked
from tests.support.fresh import measure_fresh

LINES = 60_000


def _file(lines: int) -> io.BytesIO:
    out = io.BytesIO()
    for i in range(lines):
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": f"Tell {i} things."}],
            "max_tokens": 300,
        }
        row = {"custom_id": f"request-{i:09d}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        out.write(json.dumps(row).encode() + b"\n")
    out.seek(0)
    return out


def measure(lines: int = LINES) -> dict:
    """Validate `lines` lines under tracemalloc: (peak, held after) bytes a request, and checks of the result."""
    reader = _file(lines)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        validator = Validator("/v1/chat/completions", ["m"], 10**9)
        checked = Checked("", validator.result)
        validate_stream(reader, validator, checked.add)
        peak = tracemalloc.get_traced_memory()[1] - base
        index = checked.builder.build()
        del validator  # the id table goes with the pass; the index and the tally stay for the batch
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    first = reader.getvalue().split(b"\n")[0]
    return {
        "ok": checked.result.total == lines and len(index) == lines and not checked.result.errors,
        "first_lines": [int(n) for n in index.lines[:3]],
        "first_length_right": int(index.ends[0] - index.starts[0]) == len(first),
        "peak": peak / lines,
        "held": held / lines,
    }


@pytest.mark.slow  # 60,000 lines under tracemalloc: ~11 s
@pytest.mark.subprocess  # a fresh interpreter (tests/support/fresh.py)
def test_validating_holds_tens_of_bytes_a_request_not_hundreds():
    result = measure_fresh("tests.runtime.test_validation_memory", "measure")
    assert result["ok"] and result["first_lines"] == [1, 2, 3] and result["first_length_right"], result
    print(
        f"validating {LINES:,} lines: peak {result['peak']:.0f} B a request, {result['held']:.0f} B held after"
    )
    assert result["peak"] < 150  # 380 with lists and a dict; 156 with one custom_id table and 8-byte columns
    assert result["held"] < 48  # the index (28) and the tally (12)


def test_first_lines_finds_every_repeat_with_its_first_line_across_growth():
    table = FirstLines(slots=8)  # each shard grows many times
    ids = [os.urandom(6).hex() for _ in range(20_000)]
    for line, custom_id in enumerate(ids, start=1):
        assert table.setdefault(_digest(custom_id), line) == line  # new: no false repeat
    assert len(table) == len(ids)
    for line, custom_id in enumerate(ids[::997], start=1):
        assert table.setdefault(_digest(custom_id), 10**6 + line) == ids.index(custom_id) + 1
    assert len(table) == len(ids)


def test_a_repeated_custom_id_names_its_first_line():
    rows = [
        {"custom_id": c, "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "hi"}}
        for c in ("a", "b", "c", "b", "a")
    ]
    reader = io.BytesIO(b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    result = validate_stream(reader, Validator("/v1/completions", ["m"], 100))
    found = [(e["line"], e["message"]) for e in result.errors if e["code"] == "duplicate_custom_id"]
    assert found == [(4, "custom_id 'b' already used on line 2"), (5, "custom_id 'a' already used on line 1")]
