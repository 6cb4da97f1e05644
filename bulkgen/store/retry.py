"""Which S3 failures are worth another try, and how S3 errors map onto the store's own errors.

Throttling, 5xx and dropped connections are transient: retry with exponential backoff and jitter,
so many workers hitting one bucket spread out instead of retrying in lockstep. A 4xx is an answer
(missing key, lost condition, no permission): retrying it only adds latency.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from boto3.exceptions import S3TransferFailedError, S3UploadFailedError
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential
from urllib3.exceptions import ProtocolError

from bulkgen.store.base import NotFound, PreconditionFailed, StorageUnavailable

T = TypeVar("T")

RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
    }
)
DROPPED_CONNECTION = (
    EndpointConnectionError,
    ConnectionClosedError,
    ConnectTimeoutError,
    ReadTimeoutError,
    ResponseStreamingError,
    ProtocolError,
)
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
PRECONDITION_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "412"})
CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
        "InvalidClientTokenId",
    }
)


def error_code(exc: ClientError) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a botocore ClientError."""
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return code, status


def is_retryable(exc: BaseException) -> bool:
    """True for throttling, 5xx and dropped connections; never for 4xx answers like NoSuchKey."""
    if isinstance(exc, ClientError):
        code, status = error_code(exc)
        return code in RETRYABLE_CODES or status >= 500
    return isinstance(exc, DROPPED_CONNECTION)


def call_with_retries(fn: Callable[[], T], *, attempts: int, base_delay: float, max_delay: float) -> T:
    """Run `fn`, retrying transient failures; the last failure is re-raised unchanged."""
    retrying = Retrying(
        retry=retry_if_exception(is_retryable),
        wait=wait_random_exponential(multiplier=base_delay, max=max_delay),
        stop=stop_after_attempt(attempts),
        reraise=True,
    )
    return retrying(fn)


def storage_reason(exc: BaseException, endpoint: str | None = None) -> str:
    """Why the storage cannot be used, in words a new user acts on (one line, no traceback)."""
    where = endpoint or "the default AWS S3 endpoint"
    if isinstance(exc, (ClientError, S3UploadFailedError, S3TransferFailedError)):
        inner = exc if isinstance(exc, ClientError) else (exc.__context__ or exc)
        if isinstance(inner, ClientError):
            code, status = error_code(inner)
            message = inner.response.get("Error", {}).get("Message") or ""
            if code == "NoSuchBucket":
                return "no such bucket"
            if code in CREDENTIAL_CODES:
                return f"bad credentials ({code}: {message})".replace(": )", ")")
            if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
                return f"access denied ({code or status})"
            answer = f"{status} {code}" if code and code != str(status) else str(status)
            if is_retryable(inner):
                return f"{where} kept answering {answer} after the retries"
            return f"{where} answered {answer}: {message}".rstrip(": ")
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError)):
        return f"unreachable: cannot connect to {where}"
    if isinstance(exc, DROPPED_CONNECTION):
        return f"unreachable: the connection to {where} failed ({type(exc).__name__})"
    if isinstance(exc, BotoCoreError):  # NoCredentialsError, PartialCredentialsError, ...
        return f"bad credentials or configuration: {exc}"
    return f"{type(exc).__name__}: {exc}"


def map_client_error(exc: ClientError, key: str, *, conditional_write: bool = False) -> Exception:
    """NotFound / PreconditionFailed for the answers callers act on; other errors pass through."""
    code, status = error_code(exc)
    if code in PRECONDITION_CODES or status == 412:
        return PreconditionFailed(key, f"S3 answered {code or status}")
    if code == "NoSuchBucket":
        return exc
    if code in NOT_FOUND_CODES or status == 404:
        # a conditional put on a missing key answers 404: the condition did not hold
        return (
            PreconditionFailed(key, "the key does not exist (if_match)")
            if conditional_write
            else NotFound(key)
        )
    return exc


@contextmanager
def store_errors(
    key: str, *, url: str = "s3", endpoint: str | None = None, conditional_write: bool = False
) -> Iterator[None]:
    """Raise NotFound / PreconditionFailed in place of the S3 errors that mean them, and
    StorageUnavailable for every failure of the storage itself (after the retries)."""
    try:
        yield
    except ClientError as exc:
        mapped = map_client_error(exc, key, conditional_write=conditional_write)
        if mapped is exc:
            raise StorageUnavailable(url, storage_reason(exc, endpoint)) from exc
        raise mapped from exc
    except (BotoCoreError, S3UploadFailedError, S3TransferFailedError, ProtocolError) as exc:
        raise StorageUnavailable(url, storage_reason(exc, endpoint)) from exc
