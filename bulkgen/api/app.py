"""The FastAPI application: routes, error shapes, health and Prometheus metrics."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from bulkgen import __version__
from bulkgen.api import auth, batches, errors, files
from bulkgen.api.prometheus import RecordCache, render_metrics
from bulkgen.tenants import KeyRing


def create_app(svc, manager, api_key: str | None = None, keyring: KeyRing | None = None) -> FastAPI:
    """`svc`: bulkgen.batch.service.BatchService (its tenant answers keyless callers); `manager`: runs
    batches. `keyring` (tenants and their key hashes) or `api_key` (one key, svc's tenant) require keys."""
    app = FastAPI(title="bulkgen", version=__version__, docs_url="/docs", redoc_url=None)
    app.state.svc, app.state.manager = svc, manager
    errors.install(app)
    if keyring is None and api_key:
        keyring = KeyRing.single(api_key, svc.tenant)
    auth.install(app, keyring, svc.tenant)
    app.include_router(files.router)
    app.include_router(batches.router)

    @app.get("/v1/models")
    async def list_models() -> dict:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "bulkgen"} for name in svc.settings.models]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "version": __version__}

    records = RecordCache(svc)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = await run_in_threadpool(render_metrics, records, manager)
        return Response(body, media_type=content_type)

    return app
