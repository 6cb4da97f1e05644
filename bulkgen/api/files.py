"""Files API: upload, list, retrieve, download and delete JSONL files."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from bulkgen.api.auth import service_of
from bulkgen.api.protocol import (
    ID,
    UPLOAD_FORM,
    UPLOAD_PURPOSES,
    FileDeleted,
    FileList,
    FileObject,
    answers,
    errors,
)
from bulkgen.api.upload import receive_upload
from bulkgen.batch.records import check_expires_after
from bulkgen.batch.schema import InvalidRequest, quote

router = APIRouter(prefix="/v1/files")
FILE_ID = Path(json_schema_extra=ID)


_UPLOAD = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": UPLOAD_FORM}}}}


@router.post("", response_model=None, responses=answers(FileObject, 408, 413), openapi_extra=_UPLOAD)
async def create_file(request: Request) -> dict:
    """Multipart `file` + `purpose` (+ `expires_after[anchor]`, `expires_after[seconds]`): the file
    streams to storage as it arrives and is refused (413 file_too_large) once past the limit; any other
    field is refused by name. Purpose `batch` for input files, `vision` or `user_data` for images that
    request lines name by file id (bulkgen.batch.images)."""
    svc = service_of(request)
    files, limit = svc.files, svc.settings.max_file_bytes
    fields, name, file_id, size = await receive_upload(request, limit, files.upload_data, files.discard_data)
    try:
        purpose = fields.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequest(
                f"purpose must be one of {list(UPLOAD_PURPOSES)}; got {quote(purpose)}", param="purpose"
            )
        expires = check_expires_after(
            fields.get("expires_after[seconds]"), fields.get("expires_after[anchor]")
        )
        return await run_in_threadpool(files.write_meta, file_id, size, name, purpose, expires)
    except BaseException:
        await run_in_threadpool(files.discard_data, file_id)
        raise


@router.get("", response_model=None, responses=answers(FileList))
async def list_files(
    request: Request,
    after: str = Query(None, json_schema_extra=ID),  # a string if given: never null in a query
    limit: int = Query(10000, ge=1, le=10000),
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> dict:
    files = service_of(request).files
    items, has_more = await run_in_threadpool(files.list, after, limit, order, purpose)
    return page(items, has_more)


@router.get("/{file_id}", response_model=None, responses=answers(FileObject, 404))
async def retrieve_file(request: Request, file_id: str = FILE_ID) -> dict:
    return await run_in_threadpool(service_of(request).files.get, file_id)


_JSONL = {"description": "The file's bytes", "content": {"application/jsonl": {"schema": {"type": "string"}}}}


@router.get("/{file_id}/content", response_class=StreamingResponse, responses={200: _JSONL, **errors(404)})
async def file_content(request: Request, file_id: str = FILE_ID) -> StreamingResponse:
    files = service_of(request).files
    stream = await run_in_threadpool(files.open, file_id)

    def chunks():
        with stream:
            while block := stream.read(1024 * 1024):
                yield block

    return StreamingResponse(chunks(), media_type="application/jsonl")


@router.delete("/{file_id}", response_model=None, responses=answers(FileDeleted, 404, 409))
async def delete_file(request: Request, file_id: str = FILE_ID) -> dict:
    await run_in_threadpool(service_of(request).delete_file, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def page(items: list[dict], has_more: bool) -> dict:
    """The spec's ListFilesResponse: first_id and last_id are required strings, so an empty page has ""."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else "",
        "last_id": items[-1]["id"] if items else "",
        "has_more": has_more,
    }
