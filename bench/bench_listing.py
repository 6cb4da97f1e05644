"""`GET /v1/files` and `GET /v1/batches` p50 / p90 as what is stored grows: 1 to 10,000 files and batches.

The API app in this process (starlette's TestClient: no sockets; no workers, the batch manager is not
started) over a local folder (default) or an S3 bucket (`--s3 URL` with `--endpoint`, e.g. a moto
server). At each size, files and batch records are added (file records through FileRepo.write_meta,
batch records through BatchRepo.create) up to that count, then, after RACY_S seconds (a local folder
keeps its sorted index only once it has settled), `--requests` requests of each route are timed, half
the first page and half a page after a cursor in the middle:

- GET /v1/files?limit=20 and GET /v1/batches (the default limit, 20): pages of a fixed size, which
  should cost the same whatever is stored (goal: p90 within 1.5x up to 10,000; the ratios are to the
  first size at which both pages are full, FULL (41): with 20 stored the page after the middle holds
  9 records, not 20, and with 1 stored the first page holds 1);
  the CPU column (this process's CPU per request, app and client) is the figure a busy machine moves least;
- GET /v1/files (no limit: OpenAI's default of 10,000, which bulkgen keeps): the whole list, O(stored) by
  contract; timed `--default-requests` times only, for scale.

    python bench/bench_listing.py [--sizes 1 20 50 100 1000 10000] [--requests 200]
    python bench/bench_listing.py --s3 s3://bucket/prefix --endpoint http://127.0.0.1:5000 --sizes 1 20 100 1000

Ratios are measured in one run; the load average before and after is printed with them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bulkgen.api import create_app  # noqa: E402
from bulkgen.batch.batchrecord import new_batch_record  # noqa: E402
from bulkgen.batch.ids import new_id  # noqa: E402
from bulkgen.batch.records import BatchRepo, FileRepo  # noqa: E402
from bulkgen.batch.service import BatchService  # noqa: E402
from bulkgen.runtime.manager import BatchManager  # noqa: E402
from bulkgen.settings import Settings  # noqa: E402
from bulkgen.store import local, open_store  # noqa: E402

RACY_S = getattr(local, "RACY_S", 2.0)  # (an older tree, for a comparison, has none)

PAGE = 20  # the page size timed (files: limit=20; batches: the default limit)
FULL = 2 * PAGE + 1  # the fewest stored for which the page after the middle cursor is full too
CPU: dict[str, float] = {}  # route -> CPU ms of this process (app and client) over the last timing


def timed(client, url: str, count: int) -> list[float]:
    out = []
    c0 = time.process_time()
    for _ in range(count):
        t0 = time.perf_counter()
        response = client.get(url)
        out.append((time.perf_counter() - t0) * 1e3)
        assert response.status_code == 200, response.text
    CPU[url] = (time.process_time() - c0) / count * 1e3
    return out


def pct(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 20, 50, 100, 1000, 10000])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--default-requests", type=int, default=3)
    parser.add_argument("--s3", help="an s3:// URL to list in (default: a fresh local folder)")
    parser.add_argument("--endpoint", help="the S3 endpoint URL")
    args = parser.parse_args()

    from fastapi.testclient import TestClient

    url = args.s3 or tempfile.mkdtemp(prefix="bulkgen-bench-listing-")
    store = open_store(url, endpoint_url=args.endpoint) if args.s3 else open_store(url, fsync=False)
    store.create()
    svc = BatchService(Settings(storage=store.url), store=store)
    app = create_app(svc, BatchManager(svc))
    files, batches = FileRepo(store), BatchRepo(store)
    file_ids: list[str] = []
    batch_ids: list[str] = []
    print(f"storage: {'S3 ' + url if args.s3 else 'local folder'}; load average before: {os.getloadavg()}")
    routes = (f"GET /v1/files?limit={PAGE}", "GET /v1/batches", "GET /v1/files (default limit)")
    rows: dict[str, list[tuple[int, float, float, float]]] = {r: [] for r in routes}
    with TestClient(app) as client:
        for size in args.sizes:
            t0 = time.perf_counter()
            while len(file_ids) < size:
                file_ids.append(files.write_meta(new_id("file-"), 3, "f.jsonl", "batch")["id"])  # record only
            while len(batch_ids) < size:
                batch_ids.append(
                    batches.create(new_batch_record("file-x", "/v1/completions", "24h", None)).id
                )
            fill_s = time.perf_counter() - t0
            time.sleep(RACY_S + 0.1)
            mid_file, mid_batch = sorted(file_ids)[size // 2], sorted(batch_ids)[size // 2]
            half = args.requests // 2
            urls = {
                routes[0]: [f"/v1/files?limit={PAGE}", f"/v1/files?limit={PAGE}&after={mid_file}"],
                routes[1]: ["/v1/batches", f"/v1/batches?after={mid_batch}"],
                routes[2]: ["/v1/files"],
            }
            for route, pair in urls.items():
                count = half if len(pair) == 2 else args.default_requests
                values = sum((timed(client, u, count) for u in pair), [])
                cpu = statistics.mean(CPU[u] for u in pair)
                rows[route].append((size, pct(values, 50), pct(values, 90), cpu))
            print(f"  {size:>6,} stored files and batches (added in {fill_s:.1f} s)", flush=True)
    for route in routes:
        print(f"\n{route}")
        # both pages timed are full from FULL stored on: ratios are to the first such size (to the first row
        # if no size reaches it); below it the answers themselves are smaller
        base = next((r for r in rows[route] if r[0] >= FULL), rows[route][0])
        print(f"{'stored':>8} {'p50 ms':>8} {'p90 ms':>8} {'p90 ratio':>10} {'CPU ms':>8} {'CPU ratio':>10}")
        for size, p50, p90, cpu in rows[route]:
            print(
                f"{size:>8,} {p50:>8.2f} {p90:>8.2f} {p90 / base[2]:>10.2f} {cpu:>8.2f} {cpu / base[3]:>10.2f}"
            )
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
