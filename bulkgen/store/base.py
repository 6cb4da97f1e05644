"""The storage contract every backend keeps, plus the parts that are the same everywhere.

Object storage is bulkgen's system of record, so the contract is deliberately small and strict:
keys are validated once here, missing keys are always `NotFound`, and a lost conditional write is
always `PreconditionFailed`, whichever backend holds the bytes.
"""

from __future__ import annotations

import io
import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from bulkgen.store.compose import Source, SpanReader

READ_CHUNK = 1 << 20


class NotFound(KeyError):
    """The key (or prefix) holds no object."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"no object at key {self.key!r}"


class StorageUnavailable(Exception):
    """The storage itself cannot be used: unreachable, no such bucket, access denied, bad credentials,
    or still failing after the retries. `str()` is one line naming the storage and the reason."""

    def __init__(self, url: str, reason: str) -> None:
        reason = " ".join(str(reason).split())  # one line, whatever the library said
        super().__init__(f"storage {url} is unavailable: {reason}")
        self.url, self.reason = url, reason


class PreconditionFailed(Exception):
    """A conditional write lost: the object changed (if_match) or already exists (if_none_match)."""

    def __init__(self, key: str, detail: str = "") -> None:
        super().__init__(f"precondition failed for key {key!r}" + (f": {detail}" if detail else ""))
        self.key = key


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its key (relative to the store), size, and a token that changes with its bytes
    (the S3 ETag; a local file's mtime and size)."""

    key: str
    size: int
    etag: str


def check_key(key: str) -> str:
    """Reject keys that could escape the store root or mean different things on different backends."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"storage key must be a non-empty string, got {key!r}")
    if key.startswith("/") or key.endswith("/"):
        raise ValueError(f"storage key {key!r} must not start or end with '/'")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(f"storage key {key!r} has an empty, '.' or '..' segment")
    if "\\" in key or "\x00" in key:
        raise ValueError(f"storage key {key!r} must not contain a backslash or NUL")
    return key


def check_prefix(prefix: str) -> str:
    """A prefix is a key start: '' (everything), 'a/b/' (a folder) or 'a/b' (string prefix, as S3)."""
    if prefix == "":
        return prefix
    if not isinstance(prefix, str):
        raise ValueError(f"storage prefix must be a string, got {prefix!r}")
    check_key(prefix.rstrip("/") or "/")
    if prefix.endswith("//"):
        raise ValueError(f"storage prefix {prefix!r} ends with an empty segment")
    return prefix


def check_write(key: str, data: bytes, if_match: str | None, if_none_match: bool) -> bytes:
    """Validate write arguments the same way on every backend."""
    check_key(key)
    if if_match is not None and if_none_match:
        raise ValueError(f"write to {key!r}: pass if_match or if_none_match, not both")
    if if_match is not None and (not isinstance(if_match, str) or not if_match):
        raise ValueError(f"write to {key!r}: if_match must be a version token string, got {if_match!r}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"write to {key!r}: data must be bytes, got {type(data).__name__}")
    return bytes(data)


def folder_prefix(prefix: str) -> str:
    """'models/tiny' and 'models/tiny/' both mean the folder, never 'models/tiny2/...'."""
    check_prefix(prefix)
    return prefix.rstrip("/") + "/" if prefix else ""


class Store(ABC):
    """One storage URL: a local folder or an S3 bucket/prefix. Picklable; see `open_args()`."""

    url: str
    # each request is billed (S3): the runtime writes progress by the line, not by the second (runtime/pacing.py)
    billed_requests: bool = False

    @abstractmethod
    def open_args(self) -> dict[str, Any]:
        """Arguments for `open_store(**store.open_args())` that rebuild this store in another process."""

    def sub(self, prefix: str) -> Store:
        """The same storage, rooted at `prefix` under this one (a tenant's folder): keys of the result are
        relative to it, so it can never name an object outside."""
        check_key(prefix)
        args = self.open_args()
        del args["url"]  # its own class, not open_store's choice by URL: a base never imports its backends
        return type(self)(f"{self.url.rstrip('/')}/{prefix}", **args)

    @abstractmethod
    def read_bytes(self, key: str) -> bytes:
        """The whole object; NotFound if there is none."""

    @abstractmethod
    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """(bytes, version token) read together, for a later `write_bytes(..., if_match=token)`."""

    @abstractmethod
    def write_bytes(
        self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False
    ) -> str:
        """Replace the object atomically and return its new version token.

        if_match: write only if the current version is this token; if_none_match: only if no object
        exists. Otherwise PreconditionFailed, and nothing is written.
        """

    @abstractmethod
    def upload_fileobj(self, key: str, fileobj: BinaryIO) -> int:
        """Stream a file-like into the object without holding it in memory; returns bytes written."""

    @abstractmethod
    def open_read(self, key: str) -> BinaryIO:
        """A streaming binary reader (close it, or use `with`); NotFound if there is no object."""

    @abstractmethod
    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object (a ranged GET): how a worker reads its lines of a big file."""

    @abstractmethod
    def size(self, key: str) -> int:
        """Object size in bytes; NotFound if there is none."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error (retried work deletes twice)."""

    @abstractmethod
    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[str]:
        """Every key starting with `prefix` (a string prefix, as on S3), in lexicographic order, lazily."""

    @abstractmethod
    def list_objects(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """As `list`, with each object's size and version token (one listing, no request per object)."""

    @abstractmethod
    def _download_file(self, key: str, path: Path) -> None:
        """Copy one object to `path` (which the caller replaces atomically)."""

    def compose(self, key: str, spans: Iterable[Source]) -> int:
        """Write the concatenation of byte ranges of stored objects (and bytes already read) as the object
        `key`, all or nothing, and return its size: how finalize writes an output file from its parts, the
        sources consumed as they come. Here the ranges are read and
        streamed into one upload; S3 copies ranges of 5 MiB and more server-side (S3Store.compose)."""
        return self.upload_fileobj(check_key(key), io.BufferedReader(SpanReader(self, spans), READ_CHUNK))

    def create(self) -> None:
        """Make the storage where that is this program's job (a local folder), at startup only: a running
        service never re-creates storage that disappeared. A bucket is the operator's to make: nothing here."""
        return None

    def check(self, *, attempts: int | None = None) -> None:
        """A cheap look at the storage (one small listing); StorageUnavailable says why it cannot be used.
        `attempts` bounds the retries (the health check uses 1; startup keeps the store's own)."""
        next(iter(self.list("")), None)

    def exists(self, key: str) -> bool:
        """True if an object (not merely a "folder") is at `key`."""
        try:
            self.size(key)
        except NotFound:
            return False
        return True

    def stat(self, key: str) -> ObjectInfo:
        """The object's listing entry (the same token `list_objects` gives); NotFound if there is none."""
        for info in self.list_objects(check_key(key)):
            if info.key == key:
                return info
            if info.key > key:
                break
        raise NotFound(key)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under `prefix`; returns how many were deleted."""
        count = 0
        for key in list(self.list(prefix)):
            self.delete(key)
            count += 1
        return count

    def iter_lines(self, key: str) -> Iterator[bytes]:
        """Stream lines without their '\\n' (or '\\r\\n'); a last line without a newline is still yielded."""
        with self.open_read(key) as reader:
            yield from split_lines(reader)

    def download_dir(self, prefix: str, dest: Path) -> Path:
        """Mirror every object under the folder `prefix` into `dest` (e.g. a model kept in the store)."""
        folder = folder_prefix(prefix)
        dest = Path(dest)
        found = False
        for key in self.list(folder):
            found = True
            target = dest.joinpath(*key[len(folder) :].split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
            os.close(fd)
            try:
                self._download_file(key, Path(tmp))
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        if not found:
            raise NotFound(folder)
        return dest

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def redact(message: str, *locations: str) -> str:
    """`message` with each of `locations` (store URLs, folders) and their local paths written `<storage>`,
    longest first, so a tenant's folder under the root goes whole."""
    forms = {form.rstrip("/") for url in locations if url for form in (url, url.removeprefix("file://"))}
    for form in sorted((f for f in forms if f), key=len, reverse=True):
        message = message.replace(form, "<storage>")
    return message


def split_lines(reader: BinaryIO) -> Iterator[bytes]:
    """Split a byte stream on '\\n' in bounded memory (one chunk plus the longest line)."""
    tail = b""
    while chunk := reader.read(READ_CHUNK):
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        for line in lines:
            yield line[:-1] if line.endswith(b"\r") else line
    if tail:
        yield tail[:-1] if tail.endswith(b"\r") else tail


def copy_stream(src: BinaryIO, dst: BinaryIO) -> int:
    """Copy in chunks and count, because a file-like from a request body may not know its size."""
    total = 0
    while chunk := src.read(READ_CHUNK):
        dst.write(chunk)
        total += len(chunk)
    return total
