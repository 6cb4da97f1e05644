"""Bearer keys and tenants on the API: who is calling, and which tenant's service answers them.

With keys configured, every route but the open ones needs `Authorization: Bearer KEY` (as the openai SDK
sends it): no key or an unknown one is a 401 in OpenAI's error shape. The key's tenant picks the
BatchService, so a tenant's requests can only reach its own files and batches: anything else is a 404,
exactly as an id that never existed. `/metrics` takes any tenant's key and shows only totals.
Without keys, every caller is the service's own tenant (settings.tenant).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from bulkgen.api.errors import error_body
from bulkgen.tenants import KeyRing

# No data behind these: health for probes, the API's description, and the dashboard's page shell and assets.
OPEN_PATHS = ("/health", "/", "/openapi.json")
OPEN_PREFIXES = ("/ui/",)


def install(app: FastAPI, keyring: KeyRing | None, tenant: str) -> None:
    app.state.keyring, app.state.default_tenant = keyring, tenant
    if keyring is None:
        return

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        path = request.url.path
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return await call_next(request)
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if not header:
            return _unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.")
        caller = keyring.resolve(key.strip()) if scheme.lower() == "bearer" else None
        if caller is None:
            return _unauthorized("Incorrect API key provided.")
        request.state.tenant = caller.tenant
        return await call_next(request)


def tenant_of(request: Request) -> str:
    return getattr(request.state, "tenant", None) or request.app.state.default_tenant


def service_of(request: Request):
    """The calling tenant's BatchService."""
    return request.app.state.svc.for_tenant(tenant_of(request))


def _unauthorized(message: str) -> JSONResponse:
    return JSONResponse(
        error_body(message, code="invalid_api_key", error_type="invalid_request_error"),
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )
