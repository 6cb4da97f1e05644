"""An S3 bucket/prefix as the object store (AWS S3, MinIO, SeaweedFS, moto's server).

The boto3 client is created lazily and dropped when pickled, so a store can be sent to Ray
workers and used there at once. Plain calls retry through tenacity (`retry.py`); transfers
(multipart upload, parallel download) use a second client with botocore's own standard retries,
because s3transfer issues many part requests itself and a stream can only be read once.
"""

from __future__ import annotations

import base64
import hashlib
import io
import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, TypeVar
from urllib.parse import urlparse

from boto3.s3.transfer import TransferConfig
from boto3.session import Session
from botocore.config import Config

from bulkgen.store.base import (
    NotFound,
    ObjectInfo,
    PreconditionFailed,
    StorageUnavailable,
    Store,
    check_key,
    check_prefix,
    check_write,
)
from bulkgen.store.compose import Piece, Source, Span, multipart_etag, plan_pieces
from bulkgen.store.retry import call_with_retries, store_errors

T = TypeVar("T")
log = logging.getLogger("bulkgen.store")
MiB = 1 << 20
DELETE_BATCH = 1000
COMPOSE_PARTS = 4  # parts of a compose sent at once
COMPOSE_READERS = 8  # spans read at once for each uploaded part (4 x 8: the client's 32 connections)
FIRST_LIST_PAGE = 64  # keys asked for by a listing's first request (then twice as many each, to page_size)
_SESSION: Session | None = None
_SESSION_LOCK = threading.Lock()


def parse_s3_url(url: str) -> tuple[str, str]:
    """'s3://bucket/some/prefix/' -> ('bucket', 'some/prefix')."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"not an s3://bucket[/prefix] URL: {url!r}")
    if parsed.query or parsed.fragment:
        raise ValueError(f"s3 URL {url!r} must not have a query or fragment")
    root = parsed.path.strip("/")
    if root:
        check_key(root)
    return parsed.netloc, root


class S3Store(Store):
    """Objects are keys under `s3://bucket/prefix`; keys returned by `list` are relative to the prefix."""

    billed_requests = True

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        page_size: int = 1000,
        multipart_threshold: int = 8 * MiB,
        multipart_chunksize: int = 8 * MiB,
        retry_attempts: int = 6,
        retry_base_delay: float = 0.2,
        retry_max_delay: float = 10.0,
    ) -> None:
        self.bucket, self.root = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.root}" if self.root else f"s3://{self.bucket}"
        self.endpoint_url = (
            endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        )
        self.region_name = region_name
        _check_positive(url, page_size=page_size, retry_attempts=retry_attempts)
        _check_positive(url, multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize)
        self.page_size = min(page_size, 1000)
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize
        )
        self.retry = {
            "attempts": retry_attempts,
            "base_delay": retry_base_delay,
            "max_delay": retry_max_delay,
        }
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def open_args(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "endpoint_url": self.endpoint_url,
            "region_name": self.region_name,
            "page_size": self.page_size,
            "multipart_threshold": self.transfer.multipart_threshold,
            "multipart_chunksize": self.transfer.multipart_chunksize,
            "retry_attempts": self.retry["attempts"],
            "retry_base_delay": self.retry["base_delay"],
            "retry_max_delay": self.retry["max_delay"],
        }

    def __getstate__(self) -> dict[str, Any]:
        return self.open_args()

    def __setstate__(self, open_args: dict[str, Any]) -> None:
        self.__init__(**open_args)

    def _client(self, kind: str = "plain") -> Any:
        """'plain': no botocore retries (tenacity retries instead); 'transfer': botocore standard retries."""
        if self._pid != os.getpid():  # a forked child must not share the parent's HTTP connections
            self._clients, self._lock, self._pid = {}, threading.Lock(), os.getpid()
        with self._lock:
            if kind not in self._clients:
                self._clients[kind] = self._make_client(kind)
            return self._clients[kind]

    def _make_client(self, kind: str) -> Any:
        attempts = 1 if kind == "plain" else self.retry["attempts"]
        options: dict[str, Any] = {
            "retries": {"mode": "standard", "total_max_attempts": attempts},
            "connect_timeout": 10,
            "read_timeout": 60,
            "max_pool_connections": 32,
        }
        if self.endpoint_url:  # S3-compatible servers: path-style URLs, checksums only where S3 requires them
            options["s3"] = {"addressing_style": "path"}
            options["request_checksum_calculation"] = "when_required"
            options["response_checksum_validation"] = "when_required"
        return _new_client(
            endpoint_url=self.endpoint_url, region_name=self.region_name, config=Config(**options)
        )

    def _full(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def _errors(self, key: str, *, conditional_write: bool = False):
        return store_errors(
            key, url=self.url, endpoint=self.endpoint_url, conditional_write=conditional_write
        )

    def _call(
        self, key: str, fn: Callable[[], T], *, conditional_write: bool = False, attempts: int | None = None
    ) -> T:
        retry = {**self.retry, "attempts": attempts or self.retry["attempts"]}
        with self._errors(key, conditional_write=conditional_write):
            return call_with_retries(fn, **retry)

    def check(self, *, attempts: int | None = None) -> None:
        """One small listing: reaches the endpoint, finds the bucket, proves the credentials and access."""
        request = {"Bucket": self.bucket, "Prefix": f"{self.root}/" if self.root else "", "MaxKeys": 1}
        self._call("", lambda: self._client().list_objects_v2(**request), attempts=attempts)

    def _get(self, key: str) -> dict[str, Any]:
        return self._client().get_object(Bucket=self.bucket, Key=self._full(check_key(key)))

    def read_bytes(self, key: str) -> bytes:
        return self._call(key, lambda: self._get(key)["Body"].read())

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        def fetch() -> tuple[bytes, str]:
            response = self._get(key)
            return response["Body"].read(), response["ETag"]

        return self._call(key, fetch)

    def write_bytes(
        self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False
    ) -> str:
        data = check_write(key, data, if_match, if_none_match)
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self._full(key), "Body": data}
        kwargs["ContentMD5"] = base64.b64encode(hashlib.md5(data).digest()).decode()
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        tries = []

        def put() -> str:
            tries.append(1)
            return self._client().put_object(**kwargs)["ETag"]

        conditional = if_match is not None or if_none_match
        try:
            return self._call(key, put, conditional_write=conditional)
        except PreconditionFailed:
            if len(tries) > 1:  # an earlier try may have won and lost only its answer: is our body there?
                etag = self._own_write_landed(key, data)
                if etag is not None:
                    return etag
            raise

    def _own_write_landed(self, key: str, data: bytes) -> str | None:
        try:
            etag = self._call(
                key, lambda: self._client().head_object(Bucket=self.bucket, Key=self._full(key))["ETag"]
            )
        except NotFound:
            return None
        return etag if etag.strip('"') == hashlib.md5(data).hexdigest() else None

    def upload_fileobj(self, key: str, fileobj: BinaryIO) -> int:
        full = self._full(check_key(key))
        with self._errors(key):
            self._client("transfer").upload_fileobj(fileobj, self.bucket, full, Config=self.transfer)
        return self.size(key)

    def open_read(self, key: str) -> BinaryIO:
        body = self._call(key, lambda: self._get(key)["Body"])
        return io.BufferedReader(_BodyReader(body, lambda: self._errors(key)), buffer_size=1 * MiB)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""

        def fetch() -> bytes:
            full = self._full(check_key(key))
            response = self._client().get_object(
                Bucket=self.bucket, Key=full, Range=f"bytes={start}-{end - 1}"
            )
            return response["Body"].read()

        return self._call(key, fetch)

    def compose(self, key: str, spans: Iterable[Source]) -> int:
        """A multipart upload whose parts are copied server-side (UploadPartCopy) where a span reaches
        S3's 5 MiB minimum, and read and uploaded where sources are shorter (grouping: compose.plan_pieces).
        The object appears only when the upload completes; a failure aborts it, leaving nothing at `key`."""
        full = self._full(check_key(key))
        pieces = plan_pieces(spans, self.transfer.multipart_chunksize)
        first, second = next(pieces, None), next(pieces, None)
        if second is None and not (first and first.copy):  # one upload's size or less: one PUT
            data = self._read_spans(first.spans) if first else b""
            self.write_bytes(key, data)
            return len(data)
        client = self._client()
        upload = self._call(key, lambda: client.create_multipart_upload(Bucket=self.bucket, Key=full))
        upload_id = upload["UploadId"]
        try:
            etags, size = self._compose_parts(key, upload_id, itertools.chain((first, second), pieces))
        except BaseException:
            self._abort_upload(key, upload_id)
            raise
        self._complete(key, upload_id, etags, size)
        return size

    def _complete(self, key: str, upload_id: str, etags: list[str], size: int) -> None:
        """Complete the upload. A try whose answer was lost may have completed it: the retry then finds no
        such upload (404 NoSuchUpload), and the object is ours if S3 gives it the ETag of these parts and
        the composed size (as a put's retry checks its body: `_own_write_landed`). Otherwise the object
        is not what was composed: StorageUnavailable, so the caller's work is redone, not trusted."""
        full, tries = self._full(key), []
        done = {"Parts": [{"PartNumber": n, "ETag": etag} for n, etag in enumerate(etags, 1)]}

        def complete() -> None:
            tries.append(1)
            self._client().complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload=done
            )

        try:
            self._call(key, complete)
            return
        except NotFound:
            if len(tries) < 2:  # the upload was gone before any try reached it (aborted by someone)
                raise StorageUnavailable(self.url, f"the multipart upload of {key} is gone") from None
        except BaseException:
            self._abort_upload(key, upload_id)
            raise
        try:
            head = self._call(key, lambda: self._client().head_object(Bucket=self.bucket, Key=full))
            found = f"{head['ContentLength']} bytes, ETag {head['ETag']}"
        except NotFound:
            found = "no object"
        wanted = f"{size} bytes, ETag {multipart_etag(etags)}"
        if found != wanted:
            raise StorageUnavailable(
                self.url,
                f"the multipart upload of {key} was gone when its completion was retried, and {key} holds "
                f"{found}, not the {wanted} composed",
            )

    def _compose_parts(self, key: str, upload_id: str, pieces: Iterator[Piece]) -> tuple[list[str], int]:
        """Send the pieces COMPOSE_PARTS at a time, planning the next ones as earlier ones finish."""
        etags, window, size = [], deque(), 0
        with ThreadPoolExecutor(COMPOSE_PARTS, thread_name_prefix="bulkgen-compose") as pool:
            for number, piece in enumerate(pieces, 1):
                size += piece.size
                window.append(pool.submit(self._compose_part, key, upload_id, number, piece))
                if len(window) >= COMPOSE_PARTS:
                    etags.append(window.popleft().result())
            etags.extend(f.result() for f in window)
        return etags, size

    def _compose_part(self, key: str, upload_id: str, number: int, piece: Piece) -> str:
        request = {"Bucket": self.bucket, "Key": self._full(key), "UploadId": upload_id, "PartNumber": number}
        if piece.copy:
            (span,) = piece.spans
            source = {"Bucket": self.bucket, "Key": self._full(span.key)}
            copy_range = f"bytes={span.start}-{span.end - 1}"

            def copy() -> str:
                answer = self._client().upload_part_copy(
                    **request, CopySource=source, CopySourceRange=copy_range
                )
                return answer["CopyPartResult"]["ETag"]

            return self._call(span.key, copy)
        body = self._read_spans(piece.spans)
        return self._call(key, lambda: self._client().upload_part(**request, Body=body)["ETag"])

    def _read_spans(self, sources: list[Source]) -> bytes:
        def read(source: Source) -> bytes:
            if not isinstance(source, Span):
                return source
            data = self.read_range(source.key, source.start, source.end)
            if len(data) != source.size:  # a span past its object's end
                raise ValueError(f"compose: {len(data)} bytes of {source.key} where {source.size} were asked")
            return data

        if all(not isinstance(s, Span) for s in sources):
            return b"".join(sources)
        with ThreadPoolExecutor(COMPOSE_READERS, thread_name_prefix="bulkgen-compose-read") as pool:
            return b"".join(pool.map(read, sources))

    def _abort_upload(self, key: str, upload_id: str) -> None:
        """Best effort: an upload left open holds its parts (billed) until a lifecycle rule ends it."""
        full = self._full(key)
        try:
            self._call(
                key,
                lambda: self._client().abort_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id
                ),
            )
        except Exception:
            log.exception("could not abort the multipart upload %s of %s", upload_id, key)

    def _download_file(self, key: str, path: Path) -> None:
        with self._errors(key):
            self._client("transfer").download_file(
                self.bucket, self._full(key), str(path), Config=self.transfer
            )

    def size(self, key: str) -> int:
        full = self._full(check_key(key))
        return self._call(
            key, lambda: self._client().head_object(Bucket=self.bucket, Key=full)["ContentLength"]
        )

    def delete(self, key: str) -> None:
        full = self._full(check_key(key))
        self._call(key, lambda: self._client().delete_object(Bucket=self.bucket, Key=full))

    def delete_prefix(self, prefix: str) -> int:
        """Delete in batches of 1,000 keys per request instead of one request per key."""
        keys = list(self.list(prefix))
        for start in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": self._full(key)} for key in keys[start : start + DELETE_BATCH]]
            request = {"Objects": batch, "Quiet": True}
            response = self._call(
                prefix, lambda r=request: self._client().delete_objects(Bucket=self.bucket, Delete=r)
            )
            if response.get("Errors"):
                first = response["Errors"][0]
                raise OSError(
                    f"deleting under {self.url}/{prefix}: {len(response['Errors'])} failed, first {first}"
                )
        return len(keys)

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[str]:
        check_prefix(prefix)
        return (info.key for info in self._list_pages(prefix, start_after))

    def list_objects(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        return self._list_pages(prefix, start_after)

    def _list_pages(self, prefix: str, start_after: str | None) -> Iterator[ObjectInfo]:
        """Follow continuation tokens until S3 says the listing is complete: never stop at page one.
        The first request asks for FIRST_LIST_PAGE keys and each next one for twice as many, up to
        `page_size`: a caller that wants a short page (an API list page of 20) gets an answer of that
        size whatever is stored, and a whole listing costs a few requests more."""
        base = f"{self.root}/" if self.root else ""
        size = min(FIRST_LIST_PAGE, self.page_size)
        request: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base + prefix, "MaxKeys": size}
        if start_after is not None:
            request["StartAfter"] = base + start_after
        while True:
            page = self._call(prefix, lambda r=dict(request): self._client().list_objects_v2(**r))
            for item in page.get("Contents", []):
                if not item["Key"].endswith("/"):  # skip console-made "folder" markers
                    yield ObjectInfo(item["Key"][len(base) :], item["Size"], item["ETag"])
            if not page.get("IsTruncated"):
                return
            request["ContinuationToken"] = page["NextContinuationToken"]
            request["MaxKeys"] = size = min(2 * size, self.page_size)


def _new_client(**kwargs: Any) -> Any:
    """S3 clients from one shared boto3 session: a new session per client costs ~0.15 s of model loading."""
    global _SESSION
    with _SESSION_LOCK:  # boto3 sessions are not thread-safe
        if _SESSION is None:
            _SESSION = Session()
        return _SESSION.client("s3", **kwargs)


def _reset_after_fork() -> None:
    global _SESSION, _SESSION_LOCK
    _SESSION, _SESSION_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


class _BodyReader(io.RawIOBase):
    """botocore's StreamingBody as a raw stream, so callers get a normal buffered binary file."""

    def __init__(self, body: Any, errors: Any) -> None:
        self._body, self._errors = body, errors  # a connection dropped mid-stream is StorageUnavailable

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        with self._errors():
            data = self._body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()


def _check_positive(url: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"store {url!r}: {name} must be a positive integer, got {value!r}")
