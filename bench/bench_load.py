"""The HTTP API under load, and /metrics at 10 vs 10,000 stored batches.

One `bulkgen serve` subprocess on 127.0.0.1 (bundled tiny model, local storage holding 10,000 ended
batch records written beforehand through BatchRepo) and `--clients` threads, each with its own
keep-alive HTTP connection, doing `--rounds` rounds of: retrieve a file, retrieve a batch, list files,
list batches, upload a small file, and GET /health: the baseline, a route that reads no storage (its
storage probe is cached), measured under the same concurrency in the same run. Any error (an exception
or a status >= 400) is counted and makes the exit status 1. Latencies are per request as a client sees
them (the client threads share the machine with the server).

/metrics: the cost of one uncached scrape (the same `render_metrics` the route calls, its cache off),
in this process, on a store with 10 and then 10,000 stored batches; reading every record (what a scrape
would cost without the running totals) is shown beside it for scale.

    python bench/bench_load.py [--clients 200] [--rounds 5] [--batches 10000] [--json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BOUNDARY = "bulkgenbenchboundary"
LINE = (
    json.dumps(
        {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "bulkgen-tiny", "prompt": "hello", "max_tokens": 4},
        }
    )
    + "\n"
)


def multipart(data: bytes, name: str) -> bytes:
    return (
        (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            f"Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{BOUNDARY}--\r\n".encode()
    )


def fake_batches(storage: str, count: int, start: int = 0) -> list[str]:
    """Ended batch records straight into storage (what `count` finished batches leave behind)."""
    from bulkgen.batch import totals
    from bulkgen.batch.batchrecord import RequestCounts, new_batch_record
    from bulkgen.batch.records import BatchRepo
    from bulkgen.batch.schema import BatchStatus
    from bulkgen.store import LocalStore

    store = LocalStore(storage, fsync=False)
    repo, ids = BatchRepo(store), []
    summed = totals.load(store)  # what mark_ended adds as each batch ends, written once for all of them
    for _ in range(count):
        record = new_batch_record("file-bench", "/v1/completions", "24h", None)
        record.status, record.completed_at = BatchStatus.COMPLETED, record.created_at  # as if it ran
        record.request_counts = RequestCounts(total=10, completed=10)
        record.usage.update(input_tokens=100, output_tokens=80, total_tokens=180)
        repo.create(record)
        totals.add(summed, record)
        ids.append(record.id)
    store.write_bytes(totals.TOTALS_KEY, json.dumps(summed).encode())
    return ids


def metrics_cost(sizes: list[int], repeats: int = 20) -> list[dict]:
    """Milliseconds per uncached scrape (p50 of `repeats`), and reading every record instead."""
    from bulkgen.api.prometheus import RecordCache, render_metrics
    from bulkgen.batch.service import BatchService
    from bulkgen.runtime.manager import BatchManager
    from bulkgen.settings import Settings
    from bulkgen.store import LocalStore

    rows, stored = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        svc = BatchService(Settings(storage=tmp), store=LocalStore(tmp, fsync=False))
        manager = BatchManager(svc)  # not started: only its queue depth is read
        for size in sizes:
            fake_batches(tmp, size - stored)
            stored = size
            cache = RecordCache(svc, max_age_s=0)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                render_metrics(cache, manager)
                times.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            for batch_id in svc.batches.ids():
                svc.batches.get(batch_id)
            rows.append(
                {
                    "stored_batches": size,
                    "scrape_ms_p50": round(statistics.median(times), 2),
                    "read_every_record_ms": round((time.perf_counter() - t0) * 1000, 1),
                }
            )
    return rows


class Server:
    def __init__(self, storage: str) -> None:
        sock = __import__("socket").socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.log = open(f"{storage}.serve.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bulkgen", "serve", "--storage", storage, "--port", str(self.port)],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"bulkgen serve did not start; see {self.log.name}") from None
                time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def client_loop(
    port: int,
    rounds: int,
    file_ids: list[str],
    batch_ids: list[str],
    seed: int,
    results: dict,
    errors: list,
    lock: threading.Lock,
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    mine = defaultdict(list)
    upload = multipart(LINE.encode(), f"c{seed}.jsonl")
    routes = [
        ("GET /v1/files/{id}", "GET", lambda i: f"/v1/files/{file_ids[(seed + i) % len(file_ids)]}", None),
        (
            "GET /v1/batches/{id}",
            "GET",
            lambda i: f"/v1/batches/{batch_ids[(seed * 7 + i) % len(batch_ids)]}",
            None,
        ),
        ("GET /v1/files", "GET", lambda i: "/v1/files?limit=20", None),
        ("GET /v1/batches", "GET", lambda i: "/v1/batches?limit=20", None),
        ("POST /v1/files", "POST", lambda i: "/v1/files", upload),
        ("GET /metrics", "GET", lambda i: "/metrics", None),
        ("GET /health (baseline)", "GET", lambda i: "/health", None),
    ]
    for i in range(rounds):
        for name, method, path, body in routes[seed % len(routes) :] + routes[: seed % len(routes)]:
            headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"} if body else {}
            t0 = time.perf_counter()
            try:
                conn.request(method, path(i), body=body, headers=headers)
                response = conn.getresponse()
                response.read()
                if response.status >= 400:
                    errors.append(f"{name}: HTTP {response.status}")
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                continue
            mine[name].append((time.perf_counter() - t0) * 1000)
    conn.close()
    with lock:
        for name, values in mine.items():
            results[name] += values


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load(clients: int, rounds: int, stored_batches: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        storage = os.path.join(tmp, "storage")
        batch_ids = fake_batches(storage, stored_batches)
        server = Server(storage)
        try:
            file_ids = []
            for n in range(50):
                request = urllib.request.Request(
                    f"http://127.0.0.1:{server.port}/v1/files",
                    data=multipart(LINE.encode(), f"seed{n}.jsonl"),
                    headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"},
                )
                with urllib.request.urlopen(request) as response:
                    file_ids.append(json.loads(response.read())["id"])
            results, errors, lock = defaultdict(list), [], threading.Lock()
            threads = [
                threading.Thread(
                    target=client_loop,
                    args=(server.port, rounds, file_ids, batch_ids, seed, results, errors, lock),
                )
                for seed in range(clients)
            ]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
        finally:
            server.stop()
    routes = {
        name: {
            "requests": len(v),
            "p50_ms": round(percentile(v, 0.5), 1),
            "p99_ms": round(percentile(v, 0.99), 1),
        }
        for name, v in sorted(results.items())
    }
    total = sum(len(v) for v in results.values())
    return {
        "clients": clients,
        "rounds": rounds,
        "stored_batches": stored_batches,
        "wall_s": round(wall, 1),
        "requests_per_s": round(total / wall, 1),
        "errors": len(errors),
        "first_errors": errors[:5],
        "routes": routes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=10_000, help="stored batch records")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = {
        "load": load(args.clients, args.rounds, args.batches),
        "metrics": metrics_cost([10, args.batches]),
    }
    small, large = (row["scrape_ms_p50"] for row in result["metrics"])
    result["metrics_flat"] = large <= 2 * small + 1.0  # within noise: no growth with the stored batches
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        r = result["load"]
        print(
            f"{r['clients']} clients x {r['rounds']} rounds, {r['stored_batches']} stored batches: "
            f"{r['wall_s']} s, {r['requests_per_s']} req/s, {r['errors']} errors {r['first_errors']}"
        )
        print(f"{'route':<26}{'requests':>9}{'p50 ms':>9}{'p99 ms':>9}")
        for name, row in r["routes"].items():
            print(f"{name:<26}{row['requests']:>9}{row['p50_ms']:>9}{row['p99_ms']:>9}")
        print(f"{'stored batches':<16}{'/metrics scrape p50 ms':>24}{'read every record ms':>22}")
        for row in result["metrics"]:
            print(f"{row['stored_batches']:<16}{row['scrape_ms_p50']:>24}{row['read_every_record_ms']:>22}")
        print(f"/metrics flat: {result['metrics_flat']}")
    sys.exit(1 if result["load"]["errors"] or not result["metrics_flat"] else 0)


if __name__ == "__main__":
    main()
