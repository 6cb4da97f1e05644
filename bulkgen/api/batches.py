"""Batches API: create (answers `validating` at once; the runtime validates), retrieve, list, cancel, and
bulkgen's retry of an ended batch's failed lines (bulkgen.batch.retry)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError

from bulkgen.api.auth import service_of
from bulkgen.api.body import read_json_body
from bulkgen.api.files import page
from bulkgen.batch.records import check_expires_after
from bulkgen.batch.schema import public_view
from bulkgen.plan.admission import raise_if_refused
from bulkgen.runtime.driver import Driver

router = APIRouter(prefix="/v1/batches")


JSON_BODY_LIMIT = 1024 * 1024  # a create request is a few hundred bytes; metadata at most ~10 KB


class ExpiresAfter(BaseModel):
    """OpenAI's `output_expires_after`: both keys required, no other (a typo is refused, not ignored)."""

    model_config = ConfigDict(extra="forbid")
    anchor: Any
    seconds: Any  # range and type are checked by check_expires_after, with the files API's own message


class CreateBatch(BaseModel):
    """The fields of the openai SDK's `BatchCreateParams`; any other is refused by name (unknown_parameter)."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, Any] | None = None
    output_expires_after: ExpiresAfter | None = None  # {anchor: "created_at", seconds} for the result files


@router.post("")
async def create_batch(request: Request) -> dict:
    raw = await read_json_body(request, JSON_BODY_LIMIT)
    try:
        body = CreateBatch.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_input=False)) from None
    return public_view(await run_in_threadpool(_create, service_of(request), request.app.state.manager, body))


def _create(svc, manager, body: CreateBatch) -> dict:
    expiry = body.output_expires_after
    seconds = (
        None if expiry is None else check_expires_after(expiry.seconds, expiry.anchor, "output_expires_after")
    )
    record = svc.create_batch(
        body.input_file_id,
        body.endpoint,
        body.completion_window,
        body.metadata,
        output_expires_after_s=seconds,
    )
    if (
        svc.settings.refuse_infeasible
    ):  # validated, indexed and estimated now, so an infeasible batch is a 400
        driver = Driver(svc, manager)
        record, index = driver.validate(record["id"])
        raise_if_refused(record)
        driver.hand_over(record["id"], index)
    manager.wake()  # a runner validates it (unless done above): validating -> in_progress or failed
    return record


@router.get("/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str) -> dict:
    return public_view(await run_in_threadpool(service_of(request).batches.get, batch_id))


@router.get("")
async def list_batches(
    request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)
) -> dict:
    items, has_more = await run_in_threadpool(service_of(request).batches.list, after, limit)
    return page([public_view(r) for r in items], has_more)


@router.post("/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> dict:
    record = await run_in_threadpool(service_of(request).cancel, batch_id)
    request.app.state.manager.wake(batch_id)
    return public_view(record)


@router.post("/{batch_id}/retry")
async def retry_batch(request: Request, batch_id: str) -> dict:
    """An extension: a new batch of the lines of `batch_id` that did not succeed and are worth retrying."""
    record = await run_in_threadpool(service_of(request).retry, batch_id)
    request.app.state.manager.wake()
    return public_view(record)
