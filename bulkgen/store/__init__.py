"""Object storage, bulkgen's system of record: one URL holds files, batch records, parts and outputs.

    store = open_store("/var/lib/bulkgen")            # or "file:///var/lib/bulkgen"
    store = open_store("s3://bucket/prefix", endpoint_url="http://minio:9000")
    clone = open_store(**store.open_args())                # the same store in another process

`endpoint_url` (or the AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 variables) only applies to s3:// URLs.
Which key holds what: bulkgen.store.layout; changing a shared object safely: bulkgen.store.conditional.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlparse

from bulkgen.store.base import NotFound, ObjectInfo, PreconditionFailed, StorageUnavailable, Store
from bulkgen.store.local import LocalStore
from bulkgen.store.s3 import S3Store

__all__ = [
    "LocalStore",
    "NotFound",
    "ObjectInfo",
    "PreconditionFailed",
    "S3Store",
    "StorageUnavailable",
    "Store",
    "open_store",
]


def open_store(url: str, *, endpoint_url: str | None = None, **options: Any) -> Store:
    """Open the store a URL names; extra options go to the backend (e.g. S3 `page_size`)."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"storage URL must be a non-empty string, got {url!r}")
    if url.startswith("s3://"):
        return S3Store(url, endpoint_url=endpoint_url, **options)
    if url.startswith("file:"):
        return LocalStore(_file_url_path(url), **options)
    if "://" in url:
        raise ValueError(
            f"unsupported storage URL {url!r}: use a local path, file:///abs/path or s3://bucket/prefix"
        )
    return LocalStore(url, **options)


def _file_url_path(url: str) -> str:
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
        raise ValueError(f"file URL {url!r} must be absolute, like file:///abs/path")
    return unquote(parsed.path)
