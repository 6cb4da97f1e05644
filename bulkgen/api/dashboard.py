"""The web dashboard: a page shell at `/`, its scripts and styles under `/ui/`, two small JSON routes.

The shell and assets are served without a key and carry no data; everything the page shows comes from
the authenticated `/v1/...` API (with the Bearer key the page asks for), so a key sees only what the API
shows it. Everything is served from package data: the page works with no network beyond this service.
"""

from __future__ import annotations

import json
from pathlib import Path

import fastapi
from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from bulkgen.api.auth import service_of, tenant_of
from bulkgen.api.protocol import ID, errors
from bulkgen.metrics import BatchMetrics
from bulkgen.metrics.batch import LATENCY_KEYS
from bulkgen.store import NotFound, layout

STATIC = Path(__file__).resolve().parent / "static"  # served openly: bulkgen.api.auth exempts / and /ui/
MAX_POINTS = 240  # timeline points sent to the page (neighbouring buckets merged beyond that)
HISTOGRAM_BINS = 30

router = APIRouter()


@router.get("/", include_in_schema=False)
async def shell() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/v1/dashboard/workers")
async def workers(request: Request) -> dict:
    """Each worker actor: device, node IP, torch threads, loaded model, busy share over the last 30 s,
    and the caller's batches it serves (other tenants' batches are only counted, never named); and the
    caller's tenant's weight and share of the work handed to the workers so far (`fair_share`; other
    tenants are never named)."""
    manager = request.app.state.manager
    dispatcher = getattr(manager, "dispatcher", None)
    data = dispatcher.worker_states() if dispatcher is not None else []
    tenant = tenant_of(request)
    for worker in data:
        mine = [b for b in worker["batches"] if _tenant_of_batch(manager, b["id"]) == tenant]
        worker["other_batches"] = len(worker["batches"]) - len(mine)
        worker["batches"] = mine
    queue = getattr(manager, "queue", None)
    shares = queue.shares() if queue is not None else {}
    fair = shares.get(
        tenant, {"weight": queue.fair.weight(tenant) if queue is not None else 1.0, "share": 0.0}
    )
    return {"object": "list", "data": data, "fair_share": {"tenant": tenant, **fair}}


def _tenant_of_batch(manager, batch_id: str) -> str | None:
    runner = manager.runner_of(batch_id)
    return runner.svc.tenant if runner is not None else None


@router.get("/v1/dashboard/batches/{batch_id}/timeline", responses=errors(404))
async def batch_timeline(request: Request, batch_id: str = fastapi.Path(json_schema_extra=ID)) -> dict:
    """The batch's metrics over time and its latency distributions, from the runner's stored state."""
    return await run_in_threadpool(_timeline, service_of(request), batch_id)


def _timeline(svc, batch_id: str) -> dict:
    svc.batches.get(batch_id)  # 404 for another tenant's batch, as everywhere in the API
    try:
        metrics = BatchMetrics.from_state(json.loads(svc.store.read_bytes(layout.metrics_state(batch_id))))
    except (NotFound, ValueError, KeyError):
        metrics = BatchMetrics()
    histograms = {}
    for key in LATENCY_KEYS:
        counts, edges = metrics.latencies[key].histogram(HISTOGRAM_BINS)
        histograms[key] = {"counts": counts, "edges": edges}
    return {
        "object": "batch.timeline",
        "id": batch_id,
        "points": downsample(_points(metrics), MAX_POINTS),
        "histograms": histograms,
        "summary": metrics.summary() if metrics.totals["requests"] else None,
    }


def _points(metrics: BatchMetrics) -> list[dict]:
    """Timeline points plus the mean batch size (this batch's active sequences while stepping)."""
    out = []
    for point, bucket in zip(metrics.timeline.points(), metrics.timeline.buckets, strict=True):
        busy_s, active_slot_s = bucket[0], bucket[4]
        out.append({**point, "batch_size": active_slot_s / busy_s if busy_s else 0.0})
    return out


def downsample(points: list[dict], limit: int) -> list[dict]:
    """Average runs of neighbouring points so at most `limit` remain (rates stay rates)."""
    if len(points) <= limit:
        return points
    group = -(-len(points) // limit)
    out = []
    for i in range(0, len(points), group):
        run = points[i : i + group]
        merged = {
            k: sum(p[k] for p in run) / len(run)
            for k in ("output_tokens_per_s", "busy_workers", "occupancy", "batch_size")
        }
        merged.update(
            t_s=run[0]["t_s"], width_s=run[0]["width_s"] * len(run), steps=sum(p["steps"] for p in run)
        )
        out.append(merged)
    return out


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/ui", StaticFiles(directory=STATIC), name="ui")
