"""Finalize's output file on S3, from the last part to the stored file, three ways in the same run:
the parts read one GET at a time and the merge uploaded (`sequential`), read bulkgen.runtime.parts.READERS
at a time and uploaded (`parallel`: `Store.compose` of the base class, which streams), and composed by the
S3 store (`compose`: a multipart upload whose parts of 5 MiB or more are copied server-side).

A moto server runs in a subprocess (its own interpreter: the merge's threads do not share its lock) behind
the tests' proxy (tests/support/s3.py), which counts every request and holds each answer `--latency-ms`
(S3's first-byte latency is tens of ms; moto on this machine answers in about 2 ms). `--parts` parts of
`--lines-per-part` lines (each answer `--pad` bytes of text longer than a short one; every tenth line a short
refusal, an error line) are written straight to moto, then finalized each way; the outputs must be equal.

    python bench/bench_finalize.py [--parts 1000] [--lines-per-part 32] [--pad 0] [--latency-ms 20]

Prints each way's seconds, its requests per 1,000 lines, the ratios, and the load average before and after.
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulkgen.runtime import parts  # noqa: E402
from bulkgen.store import Store, open_store  # noqa: E402
from tests.support.s3 import FlakyProxy  # noqa: E402

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


def write_parts(store, count: int, per_part: int, pad: int) -> int:
    def one(first: int) -> None:
        entries = []
        for line in range(first, first + per_part):
            ok = line % 10 != 0
            if ok:
                response = {"text": f"answer {line} " + "x" * pad}
            else:  # a refusal (context_length_exceeded): short, whatever the answers' length
                response = {"status_code": 400, "body": {"error": {"code": "context_length_exceeded"}}}
            envelope = {"custom_id": f"r{line}", "response": response, "error": None}
            entries.append(parts.PartEntry.of(line, ok, envelope, (12, 3, 0)))
        parts.write_part(store, BATCH, first, first + per_part - 1, entries)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(1, count * per_part + 1, per_part)))
    return count * per_part


WAYS = {  # name -> (parts read at once, how the output is written)
    "sequential": (1, lambda store: partial(Store.compose, store)),  # the base class's: read, streamed
    "parallel": (parts.READERS, lambda store: partial(Store.compose, store)),
    "compose": (parts.READERS, lambda store: store.compose),
}


def finalize(store: Store, proxy: FlakyProxy, way: str, lines: int) -> tuple[float, dict, bytes]:
    readers, writer = WAYS[way]
    before = len(proxy.log)
    start = time.perf_counter()
    errors, tally = io.BytesIO(), parts.Tally()
    writer(store)(f"out/{way}.jsonl", parts.merge_parts(store, BATCH, errors, tally, readers))
    seconds = time.perf_counter() - start
    log = proxy.log[before:]
    lists = sum("list-type=" in path for _, path, _ in log)
    gets = sum(method == "GET" for method, _, _ in log) - lists
    per_1000 = {
        "GET": round(gets * 1000 / lines, 1),
        "PUT/POST": round(sum(m in ("PUT", "POST") for m, _, _ in log) * 1000 / lines, 2),
        "LIST": round(lists * 1000 / lines, 2),
    }
    return seconds, per_1000, store.read_bytes(f"out/{way}.jsonl") + errors.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=1000)
    ap.add_argument("--lines-per-part", type=int, default=32)
    ap.add_argument("--pad", type=int, default=0)
    ap.add_argument("--ways", default=",".join(WAYS))
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
        writer = open_store(f"s3://{bucket}/p", endpoint_url=endpoint)
        lines = write_parts(writer, args.parts, args.lines_per_part, args.pad)
        proxy.delay_s = args.latency_ms / 1000
        store = open_store(f"s3://{bucket}/p", endpoint_url=proxy.url)
        results = {}
        for way in args.ways.split(","):
            results[way] = finalize(store, proxy, way, lines)
            seconds, per_1000, _ = results[way]
            print(
                f"{way:>10}: {seconds:7.2f} s for {args.parts} parts ({lines} lines); per 1,000 lines {per_1000}"
            )
        assert len({data for _, _, data in results.values()}) == 1, "the outputs differ"
        for way in results:
            if way != "compose" and "compose" in results:
                print(f"{way} / compose: {results[way][0] / results['compose'][0]:.1f}x")
        print(
            f"{lines * (args.pad + 60) / 1e6:.0f} MB of lines; latency {args.latency_ms:g} ms per request; "
            f"load average before {load_before}, after {os.getloadavg()}"
        )
    finally:
        proxy.server.shutdown()
        moto.kill()


if __name__ == "__main__":
    main()
