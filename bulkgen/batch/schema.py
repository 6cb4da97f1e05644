"""The batch object: fields, statuses and the checks on what a client may set."""

from __future__ import annotations

import re
from enum import Enum
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")


class BatchStatus(str, Enum):
    """A batch's `status` (in the order /metrics lists them). A str, so a member equals, hashes, formats and
    serializes (json, pydantic, FastAPI) as its value: a record read back from storage compares with the
    members as it is ("failed" == BatchStatus.FAILED), as 3.11's StrEnum would, on 3.10 too."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    def __str__(self) -> str:  # Enum's would be "BatchStatus.FAILED" (in f-strings too, from 3.11)
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


ACTIVE_STATUSES = frozenset(
    {BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING, BatchStatus.CANCELLING}
)
TERMINAL_STATUSES = frozenset(
    {BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)
# ASCII digits, no spaces: "24h" as the API writes it, never "٢٤h" or " 24 h" (the OpenAPI says so too).
WINDOW_PATTERN = r"^[0-9]{1,6}h$"
_WINDOW = re.compile(WINDOW_PATTERN)  # used with fullmatch: `$` alone lets a trailing newline through
MAX_WINDOW_HOURS = 24 * 365
INTERNAL = "x_bulkgen"  # key of the fields the service keeps for itself; never shown to clients
PRIORITY_KEY = "bulkgen_priority"  # metadata extension: the batch's turn among its tenant's batches
PRIORITIES = {"high": 0, "normal": 1, "low": 2}  # lower goes first


def quote(value: Any, limit: int = 80) -> str:
    """`value` as an error message shows it: its repr, cut to `limit` characters with its full length named,
    so a 5 MB input never comes back in a 5 MB error (every message that quotes input goes through here)."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}… ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


class InvalidRequest(ValueError):
    """A client error: rendered as HTTP 400 with OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class Conflict(InvalidRequest):
    """The request is valid but the object's state forbids it (HTTP 409)."""


def parse_completion_window(window: str) -> int:
    """'24h' (or any whole number of hours, 1h to a year) to seconds."""
    match = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    hours = int(window[:-1]) if match else 0
    if not match or not 1 <= hours <= MAX_WINDOW_HOURS:
        raise InvalidRequest(
            f"completion_window must be a whole number of hours such as '24h' (1h to {MAX_WINDOW_HOURS}h); "
            f"got {quote(window)}",
            param="completion_window",
        )
    return hours * 3600


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's limits: at most 16 pairs, keys up to 64 and values up to 512 characters, all strings."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise InvalidRequest("metadata must be an object of string keys and values", param="metadata")
    if len(metadata) > 16:
        raise InvalidRequest(f"metadata has {len(metadata)} pairs; at most 16 are allowed", param="metadata")
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidRequest(f"metadata[{quote(key)}] must be a string", param=f"metadata.{key[:64]}")
        if len(key) > 64 or len(value) > 512:
            raise InvalidRequest(
                f"metadata[{quote(key)}]: keys are limited to 64 and values to 512 characters",
                param=f"metadata.{key[:64]}",
            )
    return metadata


def batch_priority(metadata: dict | None) -> int:
    """The batch's priority among its tenant's batches (0 high, 1 normal, 2 low) from
    `metadata.bulkgen_priority`; normal when absent."""
    value = (metadata or {}).get(PRIORITY_KEY, "normal")
    if value not in PRIORITIES:
        raise InvalidRequest(
            f"metadata.{PRIORITY_KEY} must be one of {', '.join(PRIORITIES)}; got {quote(value)}",
            param=f"metadata.{PRIORITY_KEY}",
        )
    return PRIORITIES[value]


def versioned(url: Any) -> Any:
    """Azure OpenAI's unversioned paths ('/chat/completions', as its docs and samples write batch lines and
    `batches.create`) name the same endpoints as OpenAI's '/v1/...': -> the '/v1/' form, which is what
    records and lines carry from here on; anything else comes back as it is (to be refused, quoted)."""
    if isinstance(url, str) and f"/v1{url}" in ENDPOINTS:
        return f"/v1{url}"
    return url


def check_endpoint(endpoint: Any) -> str:
    """The batch's endpoint in its '/v1/' form (the unversioned form is taken too: `versioned`)."""
    endpoint = versioned(endpoint)
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(
            f"endpoint must be one of {', '.join(ENDPOINTS)} (or the same without '/v1'); got "
            f"{quote(endpoint)}",
            param="endpoint",
        )
    return endpoint
