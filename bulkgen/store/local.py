"""A local folder as the object store: the default for one machine, and the model for tests.

Writes go to a temp file and `os.replace` it into place, so readers see the old or the new
object, never half of one. A conditional write's check and replace run under an `fcntl` lock
(striped by key hash, so the lock files stay few) which makes them atomic across processes on
the same machine — the same guarantee S3 gives with If-Match / If-None-Match.

The storage folder itself (the `anchor`: the root, or for a sub-store such as a tenant's folder, the root
it lies under) is made only by `create()`, which `bulkgen serve` / `run` / `watch` call at start. Every
read, list and write tells "the folder is gone or is not a folder" (StorageUnavailable: a 503, /health
degraded) from "no such key" (NotFound), so storage removed under a running service never comes back
silently empty. Folders inside the anchor are made as needed, one level at a time, never the anchor.

A listing reads each folder's names once and keeps them sorted (FolderIndex) while the folder's mtime
says nothing was added, removed or renamed in it since: a page of a big folder is then one stat and a
bisect, not a read and sort of every name. An index is kept only once the folder's mtime is RACY_S older
than the reading (as git does with its index), so a change in the same clock tick is never missed.
"""

from __future__ import annotations

import bisect
import fcntl
import functools
import hashlib
import os
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from bulkgen.store.base import (
    NotFound,
    ObjectInfo,
    PreconditionFailed,
    StorageUnavailable,
    Store,
    check_key,
    check_prefix,
    check_write,
    copy_stream,
)

INTERNAL_DIR = ".bulkgen-store"
LOCK_STRIPES = 64
RACY_S = 2.0  # a folder changed this recently is read again at every listing (coarse or skewed clocks)
INDEXED_FOLDERS = 64  # sorted folder indexes kept per process, least recently listed dropped first


def _os_errors(method):
    """A failing disk or folder (full, read-only, permission denied, gone) is StorageUnavailable."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except OSError as exc:
            raise StorageUnavailable(self.url, f"{exc.strerror or exc} ({type(exc).__name__})") from exc

    return wrapper


def content_version(data: bytes) -> str:
    """A content hash as the version token: equal bytes, equal token, like an S3 single-part ETag."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class LocalStore(Store):
    """Objects are plain files under `root`; keys map to relative paths."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = True,
        anchor: str | os.PathLike[str] | None = None,
    ) -> None:
        self.root = Path(root).expanduser().absolute()
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"local store root {str(self.root)!r} exists and is not a folder")
        self.anchor = Path(anchor).expanduser().absolute() if anchor is not None else self.root
        if self.anchor != self.root and self.anchor not in self.root.parents:
            raise ValueError(f"local store root {str(self.root)!r} is not inside {str(self.anchor)!r}")
        self.url = str(self.root)
        self.fsync = fsync

    def open_args(self) -> dict[str, Any]:
        return {"url": self.url, "fsync": self.fsync, "anchor": str(self.anchor)}

    def create(self) -> None:
        """Make the storage folder if it does not exist (at startup only; never on the fly)."""
        try:
            self.anchor.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageUnavailable(self.url, f"cannot create the folder ({exc.strerror or exc})") from None

    def check(self, *, attempts: int | None = None) -> None:
        """The folder exists and this process may write in it."""
        self._anchored()
        try:
            self._internal("tmp")
            fd, tmp = tempfile.mkstemp(dir=self.root / INTERNAL_DIR / "tmp", suffix=".check")
            os.close(fd)
            os.unlink(tmp)
        except OSError as exc:
            raise StorageUnavailable(
                self.url, f"cannot write in the folder ({exc.strerror or exc})"
            ) from None

    def _anchored(self) -> None:
        """StorageUnavailable unless the storage folder is there: a key that is missing because the
        folder is must never read as merely missing."""
        try:
            if stat.S_ISDIR(self.anchor.stat().st_mode):
                return
            reason = "it is not a folder"
        except FileNotFoundError:
            reason = "the folder does not exist (it is made only when the service starts)"
        except OSError as exc:
            reason = f"cannot look at the folder ({exc.strerror or exc})"
        raise StorageUnavailable(str(self.anchor), reason)

    def _missing(self, key: str) -> NotFound:
        """The NotFound of a key that is not there, once the folder is known to be."""
        self._anchored()
        return NotFound(key)

    def _make_dirs(self, folder: Path) -> None:
        """Make `folder` inside the anchor level by level: if the anchor is gone this fails, never makes it."""
        if folder.is_dir():
            return
        self._anchored()
        current = self.anchor
        for part in folder.relative_to(self.anchor).parts:
            current = current / part
            try:
                os.mkdir(current)
            except FileExistsError:
                pass

    def _path(self, key: str) -> Path:
        check_key(key)
        if INTERNAL_DIR in key.split("/"):  # a sub-store (a tenant's folder) keeps its own
            raise ValueError(f"storage key {key!r} is inside the reserved folder {INTERNAL_DIR!r}")
        return self.root.joinpath(*key.split("/"))

    def _internal(self, name: str) -> Path:
        path = self.root / INTERNAL_DIR / name
        self._make_dirs(path)
        return path

    @contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        stripe = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big") % LOCK_STRIPES
        fd = os.open(self._internal("locks") / f"{stripe:02d}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    @contextmanager
    def _temp_file(self) -> Iterator[tuple[BinaryIO, str]]:
        fd, tmp = tempfile.mkstemp(dir=self._internal("tmp"), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                yield fh, tmp
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _publish(self, fh: BinaryIO, tmp: str, path: Path) -> None:
        fh.flush()
        if self.fsync:
            os.fsync(fh.fileno())
        self._make_dirs(path.parent)
        os.replace(tmp, path)

    @_os_errors
    def read_bytes(self, key: str) -> bytes:
        with self.open_read(key) as fh:
            return fh.read()

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        data = self.read_bytes(key)
        return data, content_version(data)

    @_os_errors
    def write_bytes(
        self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False
    ) -> str:
        path = self._path(key)
        data = check_write(key, data, if_match, if_none_match)
        with self._temp_file() as (fh, tmp):
            fh.write(data)
            with self._locked(key):
                self._check_condition(key, path, if_match, if_none_match)
                self._publish(fh, tmp, path)
        return content_version(data)

    def _check_condition(self, key: str, path: Path, if_match: str | None, if_none_match: bool) -> None:
        if if_none_match and path.is_file():
            raise PreconditionFailed(key, "the key already exists (if_none_match)")
        if if_match is not None:
            try:
                current = content_version(path.read_bytes())
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise PreconditionFailed(key, "the key does not exist (if_match)") from None
            if current != if_match:
                raise PreconditionFailed(key, f"version is {current}, not {if_match} (if_match)")

    @_os_errors
    def upload_fileobj(self, key: str, fileobj: BinaryIO) -> int:
        path = self._path(key)
        with self._temp_file() as (fh, tmp):
            total = copy_stream(fileobj, fh)
            with self._locked(key):
                self._publish(fh, tmp, path)
        return total

    @_os_errors
    def open_read(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise self._missing(key) from None

    @_os_errors
    def read_range(self, key: str, start: int, end: int) -> bytes:
        with self.open_read(key) as f:
            f.seek(start)
            return f.read(max(0, end - start))

    def _download_file(self, key: str, path: Path) -> None:
        with self.open_read(key) as src, open(path, "wb") as dst:
            copy_stream(src, dst)

    @_os_errors
    def size(self, key: str) -> int:
        try:
            st = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            raise self._missing(key) from None
        if not stat.S_ISREG(st.st_mode):
            raise self._missing(key)
        return st.st_size

    @_os_errors
    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._locked(key):
            try:
                path.unlink()
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                self._anchored()

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[str]:
        """Walk only the folders that can hold matching keys, in S3's lexicographic key order."""
        check_prefix(prefix)
        self._anchored()
        base = prefix.rsplit("/", 1)[0] + "/" if "/" in prefix else ""
        return self._walk(self.root.joinpath(*base.split("/")), base, prefix, start_after)

    def list_objects(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        """The version token is mtime_ns + size: cheap (no read), and it changes when a file is rewritten."""
        for key in self.list(prefix, start_after=start_after):
            try:
                st = self._path(key).stat()
            except (FileNotFoundError, NotADirectoryError):  # deleted since the listing
                continue
            yield ObjectInfo(key, st.st_size, f"{st.st_mtime_ns:x}-{st.st_size:x}")

    def _walk(self, folder: Path, folder_key: str, prefix: str, start_after: str | None) -> Iterator[str]:
        """Keys of one folder sorted once, then a bisect to the first that can follow `start_after`:
        a page of a big folder costs one directory read and a sort, not a Path per entry."""
        keys = FOLDERS.keys(folder, folder_key)
        lo = bisect.bisect_left(
            keys, prefix
        )  # every match starts with prefix (its folder is the walk's root)
        if start_after is not None:
            after = bisect.bisect_right(keys, start_after)
            if after and keys[after - 1].endswith("/") and start_after.startswith(keys[after - 1]):
                after -= 1  # the folder holding start_after: keys after it may be inside
            lo = max(lo, after)
        for i in range(lo, len(keys)):  # no slice: a copy of the rest of a big folder per page
            key = keys[i]
            if not key.startswith(prefix) and not prefix.startswith(key):
                return  # sorted: past every key with the prefix
            if not key.endswith("/"):
                if key.startswith(prefix) and (start_after is None or key > start_after):
                    yield key
            elif _folder_may_match(key, prefix, start_after):
                yield from self._walk(folder / key[len(folder_key) : -1], key, prefix, start_after)


class FolderIndex:
    """Sorted names of recently listed folders, each kept with the folder's stat signature (device, inode,
    mtime) and reused while it is unchanged; `reads` counts the folders read (tests count it)."""

    def __init__(self, size: int = INDEXED_FOLDERS) -> None:
        self.size = size
        self.reads = 0
        self._kept: OrderedDict[str, tuple[tuple[int, int, int], list[str]]] = OrderedDict()
        self._lock = threading.Lock()

    def keys(self, folder: Path, folder_key: str) -> list[str]:
        """The folder's entries as sorted keys (callers must not change the list)."""
        try:
            st = os.stat(folder)
        except (FileNotFoundError, NotADirectoryError):
            return []
        signature = (st.st_dev, st.st_ino, st.st_mtime_ns)
        name = f"{folder}\0{folder_key}"
        with self._lock:
            kept = self._kept.get(name)
            if kept is not None and kept[0] == signature:
                self._kept.move_to_end(name)
                return kept[1]
        before = time.time_ns()
        keys = _sorted_keys(folder, folder_key)
        with self._lock:
            self.reads += 1
            if before - st.st_mtime_ns >= RACY_S * 1e9:  # no change can share the tick of st_mtime_ns
                self._kept[name] = (signature, keys)
                self._kept.move_to_end(name)
                while len(self._kept) > self.size:
                    self._kept.popitem(last=False)
            else:
                self._kept.pop(name, None)
        return keys


FOLDERS = FolderIndex()


def _sorted_keys(folder: Path, folder_key: str) -> list[str]:
    """The folder's entries as keys, sorted; sub-folders get a trailing '/' so sorting matches full-key order."""
    keys = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir():
                    if not (folder_key == "" and entry.name == INTERNAL_DIR):
                        keys.append(f"{folder_key}{entry.name}/")
                elif entry.is_file():
                    keys.append(folder_key + entry.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    keys.sort()
    return keys


def _folder_may_match(folder_key: str, prefix: str, start_after: str | None) -> bool:
    if not (folder_key.startswith(prefix) or prefix.startswith(folder_key)):
        return False
    # every key in the folder sorts before start_after when they differ inside the folder's own name
    return start_after is None or folder_key > start_after or start_after.startswith(folder_key)
