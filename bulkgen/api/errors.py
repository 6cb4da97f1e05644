"""OpenAI-shaped errors: bad input is a 4xx naming what and where, never a 500 or a traceback."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

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

    @app.exception_handler(StorageUnavailable)
    async def storage_down(_: Request, exc: StorageUnavailable) -> JSONResponse:
        log.warning("%s", exc)  # one line: the service keeps answering while storage is down
        body = error_body(f"{exc}; try again later", code="storage_unavailable", error_type="server_error")
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

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

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", error_type="server_error"), status_code=500
        )
