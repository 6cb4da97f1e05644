"""Finalize's merge reads the parts many at a time (bulkgen.runtime.parts.read_parts) and writes exactly what
reading them one after the other writes: the output and error lines in input order, one per request, a
retried range's lines once. On a local folder and on moto's S3 over HTTP, counted by the proxy in front
of it: one GET per part, whatever the number read at once."""

from __future__ import annotations

import io
import json
from collections import Counter

import pytest

from bulkgen.runtime import parts
from bulkgen.store import layout, open_store
from bulkgen.store.compose import MIN_PART
from tests.support.parts import merged as merged_parts
from tests.support.s3 import FAST_RETRY

BATCH = "batch_0123456789abcdef01234567"
RANGE = 32


def envelope(line: int, ok: bool, pad: int) -> dict:
    body = {"text": f"answer {line} " + "x" * pad} if ok else {"error": {"code": "boom", "line": line}}
    return {"id": f"batch_req_{line}", "custom_id": f"r{line}", "response": body, "error": None}


def write_batch(store, lines: int, pad: int) -> tuple[bytes, bytes]:
    """Parts of RANGE lines (every 7th line an error, blank input lines 10 and 11 have no entry), plus two
    retried ranges, one across two parts and one inside the first; -> the output and error files a
    sequential merge must give."""
    expected: dict[bool, list[bytes]] = {True: [], False: []}
    requests = [n for n in range(1, lines + 1) if n not in (10, 11)]
    for start in range(0, len(requests), RANGE):
        chunk = requests[start : start + RANGE]
        entries = [parts.PartEntry.of(n, n % 7 != 0, envelope(n, n % 7 != 0, pad), (3, 1, 0)) for n in chunk]
        parts.write_part(store, BATCH, chunk[0], chunk[-1], entries)
        for e in entries:
            expected[e.ok].append(e.envelope)
    for retried in (
        requests[RANGE // 2 : RANGE // 2 + RANGE],
        requests[2:9],
    ):  # their lines are in parts above
        entries = [parts.PartEntry.of(n, n % 7 != 0, envelope(n, n % 7 != 0, pad)) for n in retried]
        parts.write_part(store, BATCH, retried[0], retried[-1], entries)
    return b"".join(expected[True]), b"".join(expected[False])


@pytest.fixture(params=["local", "s3"])
def counted_store(request, tmp_path):
    """(store, request log or None): a local folder, or moto's S3 behind the counting proxy."""
    if request.param == "local":
        store = open_store(str(tmp_path / "store"))
        store.create()
        return store, None
    url, proxy = request.getfixturevalue("s3_bucket_url"), request.getfixturevalue("flaky_proxy")
    return open_store(url, endpoint_url=proxy.url, **FAST_RETRY), proxy.log


@pytest.mark.parametrize("lines, pad", [(700, 40), (2_600, 2_400)], ids=["small", "over-5MB"])
def test_parallel_merge_equals_the_sequential_one(counted_store, lines, pad):
    store, log = counted_store
    output, errors = write_batch(store, lines, pad)
    assert (len(output) > 5 << 20) == (pad > 1000)  # one case above S3's 5 MB part minimum, one below
    merged = {}
    for readers in (1, parts.READERS):
        before = len(log) if log is not None else 0
        out, err, tally = merged_parts(store, BATCH, readers)
        merged[readers] = (out, err)
        if log is not None:
            methods = Counter(method for method, path, _ in log[before:] if "list-type=" not in path)
            lists = sum("list-type=" in path for _, path, _ in log[before:])
            wanted = len(parts.iter_parts(store, BATCH)) - 1  # not the range inside part 1: it adds nothing
            assert methods == {"GET": wanted}, methods  # one GET per part, however many at once
            assert lists <= 3, lists
    assert merged[1] == merged[parts.READERS] == (output, errors)
    assert tally.completed == output.count(b"\n") and tally.failed == errors.count(b"\n")
    assert [json.loads(x)["custom_id"] for x in errors.splitlines()][:2] == ["r7", "r14"]


BIG = 2_000_000  # pad of a long part's lines: 6 or 8 of them, 12 to 16 MB a part


def long_batch(store) -> tuple[bytes, bytes]:
    """Short parts around two of over 5 MiB (33-40 with an error line, 73-80), a retried range across the
    first long part's end (38-45, tagged: its lines 41-45 come first in input order, so they win) and one
    inside the second; -> the output and error files."""
    chosen: dict[int, parts.PartEntry] = {}
    for first, last, pad, tag in [
        (1, 32, 40, ""),
        (33, 40, BIG, ""),
        (38, 45, 40, "retry "),
        (41, 72, 40, ""),
        (73, 80, BIG, ""),
        (75, 76, 40, "retry "),
    ]:
        entries = []
        for n in range(first, last + 1):
            ok = n != 35 and n % 9 != 0
            body = envelope(n, ok, pad)
            body["tag"] = tag
            entries.append(parts.PartEntry.of(n, ok, body, (2, 1, 0)))
            if n not in chosen and (tag == "" or 41 <= n <= 45):
                chosen[n] = entries[-1]
        parts.write_part(store, BATCH, first, last, entries)
    ordered = [chosen[n] for n in sorted(chosen)]
    return b"".join(e.envelope for e in ordered if e.ok), b"".join(e.envelope for e in ordered if not e.ok)


def test_long_parts_are_copied_into_the_output_and_never_downloaded(tmp_path, s3_bucket_url, flaky_proxy):
    local = open_store(str(tmp_path / "store"))
    local.create()
    s3 = open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, **FAST_RETRY)
    written = {}
    for store in (local, s3):
        output, errors = long_batch(store)
        start, ranged_start = len(flaky_proxy.log), len(flaky_proxy.ranged)
        spool, tally = io.BytesIO(), parts.Tally()
        size = store.compose("out/output.jsonl", parts.merge_parts(store, BATCH, spool, tally))
        written[store.url] = (store.read_bytes("out/output.jsonl"), spool.getvalue())
        assert size == len(output) and written[store.url] == (output, errors)
        assert (tally.completed, tally.failed) == (output.count(b"\n"), errors.count(b"\n"))
    long_keys = [key for key, first, _ in parts.iter_parts(s3, BATCH) if first in (33, 73)]
    copies = [h for _, path, h in flaky_proxy.ranged[ranged_start:] if "x-amz-copy-source" in h]
    assert sorted(h["x-amz-copy-source"].rsplit("/", 1)[1] for h in copies) == sorted(
        k.rsplit("/", 1)[1] for k in long_keys
    )
    for key in long_keys:  # read: its head line (with, for 33-40, its error line right after it) and the
        # bytes the short run before it lacks of 5 MiB, each a ranged GET; never the whole part
        gets = [h["range"] for m, p, h in flaky_proxy.ranged[ranged_start:] if m == "GET" and p.endswith(key)]
        all_gets = [p for m, p, _ in flaky_proxy.log[start:] if m == "GET" and p.endswith(key)]
        assert len(gets) == len(all_gets) == 2
        assert f"bytes=0-{parts.HEAD_PROBE - 1}" in gets
        read = sum(int(b) - int(a) + 1 for a, b in (r.removeprefix("bytes=").split("-") for r in gets))
        assert read < MIN_PART + parts.HEAD_PROBE + 1000 < s3.size(key) / 2  # error lines are short
    assert written[local.url] == written[s3.url]


def test_parts_in_the_format_before_the_head_line_still_merge(tmp_path):
    """A batch that ran across an upgrade holds parts of both formats."""
    store = open_store(str(tmp_path / "store"))
    store.create()
    entries = [parts.PartEntry.of(n, n != 2, envelope(n, n != 2, 10), (1, 1, 0)) for n in range(1, 7)]
    store.write_bytes(layout.part(BATCH, 1, 3), b"".join(e.encode() for e in entries[:3]))
    parts.write_part(store, BATCH, 4, 6, entries[3:])
    assert not store.read_bytes(layout.part(BATCH, 4, 6)).startswith(b'{"line"')
    assert [e.line for e in parts.read_part(store, layout.part(BATCH, 1, 3))] == [1, 2, 3]
    out, err, tally = merged_parts(store, BATCH)
    assert out == b"".join(e.envelope for e in entries if e.ok) and err == entries[1].envelope
    assert (tally.completed, tally.failed, tally.input_tokens) == (5, 1, 6)


def _v2_part(entries: list[parts.PartEntry]) -> bytes:
    """A part as bulkgen wrote it before errors came first: head {"v":2}, outputs, then errors."""
    rows = [[e.line, int(e.ok), len(e.envelope), *e.usage] for e in entries]
    head = json.dumps({"v": 2, "entries": rows}, separators=(",", ":")).encode() + b"\n"
    return (
        head
        + b"".join(e.envelope for e in entries if e.ok)
        + b"".join(e.envelope for e in entries if not e.ok)
    )


def test_parts_with_outputs_before_errors_still_merge(tmp_path):
    """Parts of the previous head-line format (outputs first), a short one and one over 5 MiB whose error
    line lies past its head's read, beside today's: the same files as if all were written today."""
    store = open_store(str(tmp_path / "store"))
    store.create()
    entries = [
        parts.PartEntry.of(n, n % 3 != 0, envelope(n, n % 3 != 0, BIG if n <= 4 else 10))
        for n in range(1, 13)
    ]
    store.write_bytes(layout.part(BATCH, 1, 4), _v2_part(entries[:4]))  # 8 MB, line 3 an error at its end
    store.write_bytes(layout.part(BATCH, 5, 8), _v2_part(entries[4:8]))
    parts.write_part(store, BATCH, 9, 12, entries[8:])
    assert store.size(layout.part(BATCH, 1, 4)) >= parts.COPY_AT
    assert [e.line for e in parts.read_part(store, layout.part(BATCH, 1, 4))] == [1, 2, 3, 4]
    out, err, tally = merged_parts(store, BATCH)
    assert out == b"".join(e.envelope for e in entries if e.ok)
    assert err == b"".join(e.envelope for e in entries if not e.ok)
    assert (tally.completed, tally.failed) == (8, 4)
