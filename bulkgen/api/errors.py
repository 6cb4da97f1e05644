"""OpenAI-shaped errors: bad input is a 4xx naming what and where, never a 500 or a traceback."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from bulkgen.batch.records import RecordNotFound
from bulkgen.batch.schema import Conflict, InvalidRequest, quote
from bulkgen.store import StorageUnavailable

log = logging.getLogger(__name__)


def error_body(
    message: str, param: str | None = None, code: str | None = None, error_type: str = "invalid_request_error"
) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def install(app: FastAPI) -> None:
    @app.exception_handler(InvalidRequest)
    async def invalid(_: Request, exc: InvalidRequest) -> JSONResponse:
        status = getattr(
            exc, "status", 409 if isinstance(exc, Conflict) else 400
        )  # 408, 413, 415: bulkgen.api.body
        return JSONResponse(error_body(exc.message, exc.param, exc.code), status_code=status)

    @app.exception_handler(ClientDisconnect)
    async def went_away(request: Request, _: ClientDisconnect) -> Response:
        log.info("client went away during %s %s; nothing was stored", request.method, request.url.path)
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(RecordNotFound)
    async def not_found(_: Request, exc: RecordNotFound) -> JSONResponse:
        return JSONResponse(error_body(str(exc), code="not_found"), status_code=404)

    app.add_exception_handler(StorageUnavailable, storage_down)

    @app.exception_handler(RequestValidationError)
    async def bad_shape(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = quote(".".join(str(p) for p in first.get("loc", ()) if p != "body"), 64).strip("'")
        if first.get("type") == "extra_forbidden":
            message = f"unknown field {where}: bulkgen refuses what it cannot honour; remove it"
            return JSONResponse(error_body(message, where, "unknown_parameter"), status_code=400)
        if first.get("type") == "json_invalid":
            return JSONResponse(
                error_body("the body is not valid JSON", None, "invalid_json"), status_code=400
            )
        message = (
            f"{where}: {first.get('msg', 'invalid request')}"
            if where
            else first.get("msg", "invalid request")
        )
        return JSONResponse(error_body(message, where or None, "invalid_request"), status_code=400)

    app.add_exception_handler(HTTPException, router_answer)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", error_type="server_error"), status_code=500
        )


async def storage_down(request: Request, exc: StorageUnavailable) -> JSONResponse:
    """503 while storage is down. The details (the storage's path or URL, its endpoint, the library's
    words) are the operator's: one log line here; clients learn only that storage is down, never where."""
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    body = error_body(
        "storage unavailable; try again later", code="storage_unavailable", error_type="server_error"
    )
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


async def router_answer(request: Request, exc: HTTPException) -> JSONResponse:
    """The router's own answers, in OpenAI's words: an unknown path is "Invalid URL (METHOD /path)"; a
    known path asked with another method is a 405 whose `Allow` names every method of that path
    (Starlette's names only the first route's, and /v1/files has two)."""
    where = f"{request.method} {request.url.path[:200]}"
    if exc.status_code == 404:
        return JSONResponse(error_body(f"Invalid URL ({where})"), status_code=404)
    if exc.status_code == 405:
        allow = ", ".join(_methods_of(request))
        body = error_body(f"Method not allowed ({where}); this path takes {allow}", code="method_not_allowed")
        return JSONResponse(body, status_code=405, headers={"Allow": allow})
    body = error_body(str(exc.detail), code=str(exc.status_code))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


_METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")


def _methods_of(request: Request) -> list[str]:
    """Every method some route takes on the request's path: each asked of the router as it routes (FastAPI
    keeps included routers as routes of their own, so the routes' `methods` cannot simply be read)."""
    routes = request.app.router.routes
    return [
        method
        for method in _METHODS
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)
    ]
