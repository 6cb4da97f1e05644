"""The FastAPI application: routes, error shapes, health and Prometheus metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from bulkgen import __version__
from bulkgen.api import auth, batches, dashboard, errors, files, openapi
from bulkgen.api.auth import tenant_of
from bulkgen.api.guard import Guard
from bulkgen.api.prometheus import RecordCache, render_metrics
from bulkgen.api.protocol import Health, Model, ModelList, answers
from bulkgen.batch.schema import ENDPOINTS
from bulkgen.engine.model.weight_format import served_weights
from bulkgen.settings import BODY_TIMEOUT_S
from bulkgen.store import StorageUnavailable
from bulkgen.tenants import KeyRing

_PROMETHEUS = {
    "description": "Prometheus' text format",
    "content": {"text/plain": {"schema": {"type": "string"}}},
}


class StorageProbe:
    """The storage's state for /health: one cheap check (a single try) at most every `max_age_s`."""

    def __init__(self, store, max_age_s: float = 5.0) -> None:
        self.store, self.max_age_s = store, max_age_s
        self.at, self.last = float("-inf"), "ok"
        self._lock = threading.Lock()

    def state(self) -> str:
        with self._lock:
            if time.monotonic() - self.at >= self.max_age_s:
                try:
                    self.store.check(attempts=1)
                    self.last = "ok"
                except StorageUnavailable as exc:
                    self.last = f"unavailable: {exc.reason}"
                self.at = time.monotonic()
            return self.last


def create_app(
    svc,
    manager,
    api_key: str | None = None,
    keyring: KeyRing | None = None,
    *,
    allowed_hosts: Iterable[str] = (),
    body_timeout_s: float = BODY_TIMEOUT_S,
) -> FastAPI:
    """`svc`: bulkgen.batch.service.BatchService (its tenant answers keyless callers); `manager`: runs
    batches. `keyring` (tenants and their key hashes) or `api_key` (one key, svc's tenant) require keys.
    `allowed_hosts`: Host names answered besides the bound address ("*": any; bulkgen.api.guard);
    `body_timeout_s`: how long a request body may stall before it is refused (bulkgen.api.body)."""
    # No Swagger page: it loads its scripts from a CDN (offline it is blank); /openapi.json describes the API.
    app = FastAPI(title="bulkgen", version=__version__, docs_url=None, redoc_url=None)
    app.state.svc, app.state.manager, app.state.body_timeout_s = svc, manager, body_timeout_s
    errors.install(app)
    if keyring is None and api_key:
        keyring = KeyRing.single(api_key, svc.tenant)
    auth.install(app, keyring, svc.tenant)
    app.include_router(files.router)
    app.include_router(batches.router)
    dashboard.install(
        app
    )  # the page shell at / and its assets under /ui/ (open); its data comes from /v1/...
    app.add_middleware(Guard, allowed_hosts=allowed_hosts)  # added last: outermost, before the key check
    openapi.install(app, keyed=keyring is not None)

    _install_models(app, svc)
    probe = app.state.storage_probe = StorageProbe(svc.root)

    @app.get("/health", response_model=None, responses=answers(Health))
    async def health() -> dict:
        """Always 200 while the process answers (restarting it would not bring storage back);
        `status` is "degraded" and `storage` says why while the storage cannot be used."""
        storage = await run_in_threadpool(probe.state)
        return {"status": "ok" if storage == "ok" else "degraded", "storage": storage, "version": __version__}

    records = app.state.metrics_cache = RecordCache(svc)

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: _PROMETHEUS})
    async def metrics() -> Response:
        """Prometheus' text format: totals of every tenant's batches, the queue and the workers."""
        body, content_type = await run_in_threadpool(render_metrics, records, manager)
        return Response(body, media_type=content_type)

    return app


def _install_models(app: FastAPI, svc) -> None:
    """/v1/models: every served model answers every endpoint (embeddings pool its final hidden states:
    bulkgen.engine.features.pooling), and so does each LoRA adapter, with its model as `parent` (vLLM's field).
    Each entry says how the workers hold the weights: quantization, weight and KV-cache dtypes
    (bulkgen.engine.model.weight_format), read once from the model's config.json and the engine settings; an
    adapter runs on its parent's weights and reports the parent's."""
    engine = svc.settings.workers.engine_kwargs
    weights = {
        name: served_weights(path, engine.get("quantize"), engine.get("kv_cache_dtype", "auto"))
        for name, path in svc.settings.models.items()
    }

    def served(tenant: str) -> list[dict]:
        def entry(name: str, parent: str | None) -> dict:
            return {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "bulkgen",
                "endpoints": list(ENDPOINTS),
                "parent": parent,
                **weights[parent or name],
            }

        adapters = sorted(svc.catalog.adapters(tenant).values(), key=lambda a: a.name)  # the caller's only
        return [entry(name, None) for name in svc.settings.models] + [entry(a.name, a.base) for a in adapters]

    @app.get("/v1/models", response_model=None, responses=answers(ModelList))
    async def list_models(request: Request) -> dict:
        return {"object": "list", "data": served(tenant_of(request))}

    @app.get("/v1/models/{model:path}", response_model=None, responses=answers(Model, 404))
    async def retrieve_model(model: str, request: Request):
        """One served model (the SDK's models.retrieve); an unknown one, or an adapter scoped to other
        tenants, is a 404 in OpenAI's shape."""
        found = [entry for entry in served(tenant_of(request)) if entry["id"] == model]
        if found:
            return found[0]
        body = errors.error_body(f"The model {model[:64]!r} does not exist", "model", "model_not_found")
        return JSONResponse(body, status_code=404)
