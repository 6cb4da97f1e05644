"""Batches API: create (answers `validating` at once; the runtime validates), retrieve, list, cancel, and
bulkgen's retry of an ended batch's failed lines (bulkgen.batch.retry)."""

from __future__ import annotations

from fastapi import APIRouter, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from bulkgen.api.auth import service_of
from bulkgen.api.body import read_json_body
from bulkgen.api.files import page
from bulkgen.api.protocol import ID, Batch, BatchList, CreateBatch, answers
from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.records import check_expires_after
from bulkgen.runtime.driver import Driver

router = APIRouter(prefix="/v1/batches")


JSON_BODY_LIMIT = 1024 * 1024  # a create request is a few hundred bytes; metadata at most ~10 KB
BATCH_ID = Path(json_schema_extra=ID)
_CREATE = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/CreateBatch"}}},
    }
}


@router.post("", response_model=None, responses=answers(Batch, 408, 413, 415), openapi_extra=_CREATE)
async def create_batch(request: Request) -> dict:
    """The body is read here (under a byte limit and a stall timeout, as JSON only) and parsed with
    CreateBatch, whose schema /openapi.json shows (bulkgen.api.openapi adds it to the components)."""
    raw = await read_json_body(request, JSON_BODY_LIMIT)
    try:
        body = CreateBatch.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_input=False)) from None
    return (await run_in_threadpool(_create, service_of(request), request.app.state.manager, body)).public()


def _create(svc, manager, body: CreateBatch) -> BatchRecord:
    expiry = body.output_expires_after
    seconds = (
        None if expiry is None else check_expires_after(expiry.seconds, expiry.anchor, "output_expires_after")
    )
    driver = Driver(svc, manager)
    return driver.admit(
        driver.accept(body.input_file_id, body.endpoint, body.completion_window, body.metadata, seconds)
    )


@router.get("/{batch_id}", response_model=None, responses=answers(Batch, 404))
async def retrieve_batch(request: Request, batch_id: str = BATCH_ID) -> dict:
    return (await run_in_threadpool(service_of(request).batches.get, batch_id)).public()


@router.get("", response_model=None, responses=answers(BatchList))
async def list_batches(
    request: Request,
    after: str = Query(None, json_schema_extra=ID),  # a string if given: never null in a query
    limit: int = Query(20, ge=1, le=100),
) -> dict:
    items, has_more = await run_in_threadpool(service_of(request).batches.list, after, limit)
    return page([r.public() for r in items], has_more)


@router.post("/{batch_id}/cancel", response_model=None, responses=answers(Batch, 404, 409))
async def cancel_batch(request: Request, batch_id: str = BATCH_ID) -> dict:
    record = await run_in_threadpool(service_of(request).cancel, batch_id)
    request.app.state.manager.wake(batch_id)
    return record.public()


@router.post("/{batch_id}/retry", response_model=None, responses=answers(Batch, 404, 409))
async def retry_batch(request: Request, batch_id: str = BATCH_ID) -> dict:
    """An extension: a new batch of the lines of `batch_id` that did not succeed and are worth retrying."""
    record = await run_in_threadpool(service_of(request).retry, batch_id)
    request.app.state.manager.wake()
    return record.public()
