"""Finalize's merge reads the parts many at a time (bulkgen.runtime.parts.read_parts) and writes exactly what
reading them one after the other writes: the output and error lines in input order, one per request, a
retried range's lines once. On a local folder and on moto's S3 over HTTP, counted by the proxy in front
of it: one GET per part, whatever the number read at once."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bulkgen.runtime import parts
from bulkgen.store import open_store
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
        out, err, tally = parts.merge_parts(store, BATCH, readers)
        with out, err:
            merged[readers] = (out.read(), err.read())
        if log is not None:
            methods = Counter(method for method, path, _ in log[before:] if "list-type=" not in path)
            lists = sum("list-type=" in path for _, path, _ in log[before:])
            wanted = len(parts.iter_parts(store, BATCH)) - 1  # not the range inside part 1: it adds nothing
            assert methods == {"GET": wanted}, methods  # one GET per part, however many at once
            assert lists <= 3, lists
    assert merged[1] == merged[parts.READERS] == (output, errors)
    assert tally.completed == output.count(b"\n") and tally.failed == errors.count(b"\n")
    assert [json.loads(x)["custom_id"] for x in errors.splitlines()][:2] == ["r7", "r14"]
