"""/openapi.json: FastAPI's description of the routes and their models (bulkgen.api.protocol), finished with
what every route shares and FastAPI cannot see:

- the errors any route may answer: 400 for a Host that is not this service's (bulkgen.api.guard), 503
  while storage is down or the service shuts down, 403 for a cross-site write, 401 on a service with keys;
- no 422: FastAPI lists one for its own validation errors, which bulkgen answers as 400
  (bulkgen.api.errors);
- the bearer scheme: required but for the open paths on a service with keys, optional (and ignored)
  without them.

tests/service/test_openapi.py runs schemathesis against the live service's /openapi.json.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from bulkgen.api.auth import OPEN_PATHS
from bulkgen.api.protocol import ERROR_STATUSES, CreateBatch

BEARER = "bearer"
_REQUEST_BODIES = (CreateBatch,)
_WRITES = ("post", "put", "patch", "delete")
_DESCRIPTION = (
    "OpenAI's Files and Batches API, self-hosted (the official `openai` package works unchanged), and "
    "bulkgen's extensions: retry of failed lines, batch metrics, the dashboard's data. Every error has "
    "OpenAI's shape `{error: {message, type, param, code}}`."
)


def install(app: FastAPI, keyed: bool) -> None:
    """Serve the finished description at /openapi.json (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, description=_DESCRIPTION, routes=app.routes
            )
            app.openapi_schema = finish(document, keyed)
        return app.openapi_schema

    app.openapi = openapi


def finish(document: dict[str, Any], keyed: bool) -> dict[str, Any]:
    """`document` with the shared errors, without FastAPI's 422, and with the bearer scheme."""
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            responses.pop("422", None)
            shared = [400, 503]
            if method in _WRITES:
                shared.append(403)
            if keyed and path not in OPEN_PATHS:
                shared.append(401)
            for status in sorted(shared):
                responses.setdefault(str(status), _error(status))
            if path in OPEN_PATHS:
                operation["security"] = []
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    for (
        model
    ) in _REQUEST_BODIES:  # read by the routes themselves (limits, timeouts), so FastAPI never saw them
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    document["components"]["securitySchemes"] = {
        BEARER: {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key of `bulkgen serve --api-key/--api-keys`; its tenant answers",
        }
    }
    document["security"] = [{BEARER: []}] if keyed else [{}, {BEARER: []}]
    return document


def _error(status: int) -> dict[str, Any]:
    return {
        "description": ERROR_STATUSES[status],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
