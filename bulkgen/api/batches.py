"""Batches API: create (validated at once, with every error and its line), retrieve, list, cancel."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from bulkgen.api.auth import service_of
from bulkgen.api.files import page
from bulkgen.batch.schema import public_view

router = APIRouter(prefix="/v1/batches")


class CreateBatch(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, Any] | None = None


@router.post("")
async def create_batch(request: Request, body: CreateBatch) -> dict:
    return public_view(await run_in_threadpool(_create, service_of(request), request.app.state.manager, body))


def _create(svc, manager, body: CreateBatch) -> dict:
    record = svc.create_batch(body.input_file_id, body.endpoint, body.completion_window, body.metadata)
    if record["status"] == "in_progress":
        manager.wake()
    return record


@router.get("/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str) -> dict:
    return public_view(await run_in_threadpool(service_of(request).batches.get, batch_id))


@router.get("")
async def list_batches(request: Request, after: str | None = None, limit: int = Query(20, ge=1, le=100)) -> dict:
    items, has_more = await run_in_threadpool(service_of(request).batches.list, after, limit)
    return page([public_view(r) for r in items], has_more)


@router.post("/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> dict:
    record = await run_in_threadpool(service_of(request).cancel, batch_id)
    request.app.state.manager.wake(batch_id)
    return public_view(record)
