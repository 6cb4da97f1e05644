"""Tenants and their API keys: who a bearer key is, and where that tenant's objects live.

A keys file holds one `TENANT KEY_SHA256` line per key (comments with #), so no plain key sits on disk;
`bulkgen keys add TENANT` appends a new one and prints the key once. A tenant may have several keys
(rotation: add the new one, then delete the old line). The file is re-read when it changes, so a key
added or removed takes effect without a restart.

Storage: the `default` tenant owns the storage root (the layout a single-tenant service always had);
every other tenant owns `tenants/<name>/` under it, with the same layout inside. Results, parts, leases
and reports of a batch are written under its tenant, so one tenant can never name another's objects.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TENANT = "default"
TENANT_PATTERN = r"[a-z0-9][a-z0-9_-]{0,62}"
_TENANT = re.compile(rf"^{TENANT_PATTERN}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
KEY_PREFIX = "bg-"


class KeysFileError(ValueError):
    """The keys file cannot be read or has a bad line (names the file and line)."""


def check_tenant(name: str) -> str:
    if not isinstance(name, str) or not _TENANT.match(name):
        raise ValueError(f"tenant name {str(name)[:80]!r} is not valid: use 1-63 lowercase letters, digits, "
                         "'-' or '_', starting with a letter or digit")
    return name


def tenant_prefix(name: str) -> str:
    """The folder of a tenant's objects under the storage root ('' for the default tenant)."""
    return "" if check_tenant(name) == DEFAULT_TENANT else f"tenants/{name}"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    tenant: str


class KeyRing:
    """Bearer key -> tenant. Built from a keys file, or from one plain key (`--api-key`: one tenant)."""

    def __init__(self, hashes: dict[str, str], path: Path | None = None) -> None:
        self._hashes = hashes                 # sha256 hex -> tenant
        self.path = path
        self._stamp = _stamp(path) if path else None
        self._lock = threading.Lock()

    @classmethod
    def single(cls, api_key: str, tenant: str = DEFAULT_TENANT) -> KeyRing:
        return cls({hash_key(api_key): check_tenant(tenant)})

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KeyRing:
        path = Path(path)
        return cls(read_keys_file(path), path)

    def tenants(self) -> list[str]:
        self._reload()
        return sorted(set(self._hashes.values()))

    def resolve(self, key: str | None) -> Caller | None:
        """The tenant of this key, or None (no key, or not one of ours)."""
        if not key:
            return None
        self._reload()
        given = hash_key(key)
        for known, tenant in self._hashes.items():   # compare every entry, in constant time each
            if hmac.compare_digest(given, known):
                return Caller(tenant)
        return None

    def _reload(self) -> None:
        if self.path is None:
            return
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return
        with self._lock:
            try:
                self._hashes = read_keys_file(self.path)
            except KeysFileError:
                return  # a half-written edit: keep the keys we had until the file is whole again
            self._stamp = stamp


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def read_keys_file(path: Path) -> dict[str, str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KeysFileError(f"cannot read API keys file {path}: {exc.strerror or exc}") from None
    hashes: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2 or not _SHA256.match(fields[1]):
            raise KeysFileError(f"{path}:{number}: expected 'TENANT KEY_SHA256' (64 lowercase hex digits); "
                                "create entries with `bulkgen keys add TENANT`")
        try:
            hashes[fields[1]] = check_tenant(fields[0])
        except ValueError as exc:
            raise KeysFileError(f"{path}:{number}: {exc}") from None
    return hashes


def add_key(path: str | os.PathLike[str], tenant: str) -> str:
    """Append a new random key for `tenant` to the keys file (created 0600); returns the plain key."""
    check_tenant(tenant)
    path = Path(path)
    if path.exists():
        read_keys_file(path)  # refuse to append to a file we could not read back
    path.parent.mkdir(parents=True, exist_ok=True)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(f"{tenant} {hash_key(key)}\n")
    return key
