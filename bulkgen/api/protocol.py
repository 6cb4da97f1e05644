"""The HTTP API's request and response shapes, written once as pydantic models (vLLM's `protocol.py` is the
model): the routes parse request bodies with them and /openapi.json is generated from them
(bulkgen.api.openapi), so the description is the code's own.

The response models describe; the routes return plain dicts (the records as storage keeps them), so a
field the models lack still reaches clients, and the schemathesis test (tests/service/test_openapi.py)
checks every answer against these models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bulkgen.batch.images import IMAGE_PURPOSES
from bulkgen.batch.records import ID_PATTERN, MAX_EXPIRY_S, MIN_EXPIRY_S
from bulkgen.batch.schema import ENDPOINTS, WINDOW_PATTERN, BatchStatus


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx: OpenAI's error shape."""

    error: ErrorDetail


# Why each status comes (bulkgen.api.errors, .body, .guard, .auth); routes list their own (`errors`), and
# bulkgen.api.openapi adds the ones every route may answer.
ERROR_STATUSES = {
    400: "Bad input, named in `param` (also: a Host header that is not this service's)",
    401: "No API key, or an unknown one (a service started with keys)",
    403: "A write whose Origin is not this service's own",
    404: "No such object (another tenant's is not found either)",
    408: "The request body stalled",
    409: "The object's state forbids it",
    413: "The body is over its limit",
    415: "A JSON route sent another content type",
    503: "Storage unavailable, or the service is shutting down",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` for these error statuses."""
    return {status: {"model": ErrorResponse, "description": ERROR_STATUSES[status]} for status in statuses}


def answers(model: type[BaseModel], *statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=`: `model` for 200 (the route returns a dict shaped so), then the errors."""
    return {200: {"model": model, "description": model.__doc__ or "OK"}, **errors(*statuses)}


class ExpiresAfter(BaseModel):
    """OpenAI's `output_expires_after`: both keys required, no other (a typo is refused, not ignored)."""

    model_config = ConfigDict(extra="forbid")
    # Typed loosely so that check_expires_after words the refusal, as the files API's; the schema is exact.
    anchor: Any = Field(json_schema_extra={"type": "string", "enum": ["created_at"]})
    seconds: Any = Field(
        json_schema_extra={"type": "integer", "minimum": MIN_EXPIRY_S, "maximum": MAX_EXPIRY_S}
    )


_METADATA = {
    "type": "object",
    "maxProperties": 16,
    "propertyNames": {"maxLength": 64},
    "additionalProperties": {"type": "string", "maxLength": 512},
}


class CreateBatch(BaseModel):
    """The fields of the openai SDK's `BatchCreateParams`; any other is refused by name (unknown_parameter).
    Values are checked by the batch service (bulkgen.batch.schema), whose refusals name the field."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str = Field(
        json_schema_extra={"enum": [*ENDPOINTS, *(e.removeprefix("/v1") for e in ENDPOINTS)]}
    )
    completion_window: str = Field("24h", json_schema_extra={"pattern": WINDOW_PATTERN})
    metadata: dict[str, Any] | None = Field(None, json_schema_extra={"anyOf": [_METADATA, {"type": "null"}]})
    output_expires_after: ExpiresAfter | None = None  # {anchor: "created_at", seconds} for the result files


UPLOAD_PURPOSES = ("batch", *IMAGE_PURPOSES)  # input files; images that lines name by file id
# The multipart form of POST /v1/files (bulkgen.api.upload parses it as it streams: no model parses it).
UPLOAD_FORM = {
    "type": "object",
    "required": ["file", "purpose"],
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "The JSONL file, or an image"},
        "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)},
        "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
        "expires_after[seconds]": {"type": "integer", "minimum": MIN_EXPIRY_S, "maximum": MAX_EXPIRY_S},
    },
    "dependentRequired": {
        "expires_after[anchor]": ["expires_after[seconds]"],
        "expires_after[seconds]": ["expires_after[anchor]"],
    },
    "additionalProperties": False,
}
ID = {"pattern": ID_PATTERN}  # a path id or cursor of another shape names nothing: 404 / 400


class FileObject(BaseModel):
    """A file object"""

    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output", "vision", "user_data"]
    status: str
    expires_at: int | None
    status_details: str | None = None


class FileList(BaseModel):
    """A page of files"""

    object: Literal["list"]
    data: list[FileObject]
    first_id: str
    last_id: str
    has_more: bool


class FileDeleted(BaseModel):
    """The file was deleted"""

    id: str
    object: Literal["file"]
    deleted: bool


class BatchError(BaseModel):
    code: str | None
    line: int | None
    message: str
    param: str | None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class Batch(BaseModel):
    """A batch object: OpenAI's fields, then bulkgen's own (the SDK keeps them in `model_extra`)"""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    usage: BatchUsage
    model: str | None = Field(None, description="bulkgen: the model the batch runs, once validated")
    metrics: dict[str, Any] | None = Field(None, description="bulkgen: throughput, latencies, estimate")
    retry_of: str | None = Field(None, description="bulkgen: the batch this one retries")
    retried_by: str | None = Field(None, description="bulkgen: the batch that retries this one")


class BatchList(BaseModel):
    """A page of batches, newest first"""

    object: Literal["list"]
    data: list[Batch]
    first_id: str
    last_id: str
    has_more: bool


class Model(BaseModel):
    """A served model"""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    endpoints: list[str]
    parent: str | None = Field(None, description="bulkgen: a LoRA adapter's base model; null for a model")
    quantization: str | None  # the checkpoint's method (e.g. compressed-tensors), "fp8-online", or null
    weight_dtype: (
        str  # the decoder layers' weights: e.g. float8_e4m3fn, int4; "auto": the worker's float dtype
    )
    kv_cache_dtype: str  # the engine's KV-cache dtype ("auto": the model's)


class ModelList(BaseModel):
    """The served models"""

    object: Literal["list"]
    data: list[Model]


class Health(BaseModel):
    """Always 200 while the process answers; `storage` says why when it is degraded"""

    status: Literal["ok", "degraded"]
    storage: str
    version: str
