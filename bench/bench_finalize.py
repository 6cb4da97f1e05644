"""Finalize's merge of a batch's parts on S3: one GET at a time (READERS=1, the old path) against many at
once (bulkgen.runtime.parts.READERS), in the same run.

A moto server runs in a subprocess (its own interpreter: the merge's threads do not share its lock) behind
the tests' proxy (tests/support/s3.py), which counts every request and holds each answer `--latency-ms`
(S3's first-byte latency is tens of ms; moto on this machine answers in about 2 ms). `--parts` parts of
32 short lines are written straight to moto, then merged both ways; the two outputs must be equal.

    python bench/bench_finalize.py [--parts 1000] [--latency-ms 20]

Prints each way's seconds, its requests per 1,000 lines, the ratio, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulkgen.runtime import parts  # noqa: E402
from bulkgen.store import open_store  # noqa: E402
from tests.support.s3 import FlakyProxy  # noqa: E402

LINES_PER_PART = 32
BATCH = "batch_0123456789abcdef01234567"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("moto did not start")


def write_parts(store, count: int) -> int:
    line = 0
    for _ in range(count):
        entries = []
        for _ in range(LINES_PER_PART):
            line += 1
            ok = line % 10 != 0
            envelope = {"custom_id": f"r{line}", "response": {"text": f"answer {line}"}, "error": None}
            entries.append(parts.PartEntry.of(line, ok, envelope, (12, 3, 0)))
        parts.write_part(store, BATCH, entries[0].line, entries[-1].line, entries)
    return line


def merge(store, proxy: FlakyProxy, readers: int, lines: int) -> tuple[float, dict, bytes]:
    before = len(proxy.log)
    start = time.perf_counter()
    out, err, _ = parts.merge_parts(store, BATCH, readers)
    seconds = time.perf_counter() - start
    with out, err:
        data = out.read() + err.read()
    log = proxy.log[before:]
    lists = sum("list-type=" in path for _, path, _ in log)
    per_1000 = {"GET": round((len(log) - lists) * 1000 / lines, 1), "LIST": round(lists * 1000 / lines, 2)}
    return seconds, per_1000, data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=1000)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    args = ap.parse_args()
    for name, value in {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)
    load_before = os.getloadavg()
    moto, endpoint = start_moto()
    proxy = FlakyProxy(endpoint)
    proxy.thread.start()
    try:
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        lines = write_parts(open_store(f"s3://{bucket}/p", endpoint_url=endpoint), args.parts)
        proxy.delay_s = args.latency_ms / 1000
        store = open_store(f"s3://{bucket}/p", endpoint_url=proxy.url)
        results = {}
        for readers in (1, parts.READERS):
            results[readers] = merge(store, proxy, readers, lines)
            seconds, per_1000, _ = results[readers]
            print(
                f"readers={readers:>2}: {seconds:7.2f} s for {args.parts} parts ({lines} lines); per 1,000 lines {per_1000}"
            )
        assert results[1][2] == results[parts.READERS][2], "the two merges differ"
        print(f"one at a time / {parts.READERS} at once: {results[1][0] / results[parts.READERS][0]:.1f}x")
        print(
            f"latency {args.latency_ms:g} ms per request; load average before {load_before}, after {os.getloadavg()}"
        )
    finally:
        proxy.server.shutdown()
        moto.kill()


if __name__ == "__main__":
    main()
