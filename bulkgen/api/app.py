"""The FastAPI application: routes, error shapes, health and Prometheus metrics."""

from __future__ import annotations

import secrets

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from bulkgen import __version__
from bulkgen.api import batches, errors, files
from bulkgen.api.prometheus import RecordCache, render_metrics
from bulkgen.web import install as install_dashboard
from bulkgen.web import is_open_path


def create_app(svc, manager, api_key: str | None = None) -> FastAPI:
    """`svc`: bulkgen.batch.service.BatchService; `manager`: runs batches (wake, queue_depth, workers)."""
    app = FastAPI(title="bulkgen", version=__version__, docs_url="/docs", redoc_url=None)
    app.state.svc, app.state.manager = svc, manager
    errors.install(app)
    app.include_router(files.router)
    app.include_router(batches.router)
    install_dashboard(app)  # the page shell at / and its assets under /ui/; its data comes from /v1/...

    if api_key:
        @app.middleware("http")
        async def require_key(request: Request, call_next):
            open_paths = ("/health", "/metrics")
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            path = request.url.path
            if path not in open_paths and not is_open_path(path) and not secrets.compare_digest(given, api_key):
                body = errors.error_body("invalid API key", code="invalid_api_key", error_type="authentication_error")
                return JSONResponse(body, status_code=401)
            return await call_next(request)

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
