"""Tenants and their API keys: who a bearer key is, and where that tenant's objects live.

A keys file holds one `TENANT KEY_SHA256` line per key (comments with #), so no plain key sits on disk;
`bulkgen keys add TENANT` appends a new one and prints the key once. An optional `TENANT weight=W` line
gives a tenant W times the default share of the workers when several tenants have work queued
(bulkgen.runtime.fairshare; default 1, also settable with `serve --tenant-weight TENANT=W`). A tenant may have several keys
(rotation: add the new one, then `bulkgen keys revoke sha256:PREFIX` the old one). A running service
sees a change of the file at its next request, without a restart, and fails closed (KeyRing).

Storage: the `default` tenant owns the storage root (the layout a single-tenant service always had); every
other tenant owns a folder under it (`layout.tenant_root`), with the same layout inside. Results, parts,
leases and reports of a batch are written under its tenant, so one tenant can never name another's
objects.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from bulkgen.store import layout

DEFAULT_TENANT = "default"
TENANT_PATTERN = layout.TENANT_PATTERN
_TENANT = re.compile(rf"^{TENANT_PATTERN}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
KEY_PREFIX = "bg-"
HASH_LABEL = "sha256:"  # how `bulkgen keys list` shows a key, and `bulkgen keys revoke` takes one
WEIGHT_PREFIX = "weight="  # `TENANT weight=W`: the tenant's share weight
MAX_WEIGHT = 1e6
log = logging.getLogger(__name__)


class KeysFileError(ValueError):
    """The keys file cannot be read or has a bad line (names the file and line)."""


def check_tenant(name: str) -> str:
    if not isinstance(name, str) or not _TENANT.match(name):
        raise ValueError(
            f"tenant name {str(name)[:80]!r} is not valid: use 1-63 lowercase letters, digits, "
            "'-' or '_', starting with a letter or digit"
        )
    return name


def tenant_prefix(name: str) -> str:
    """The folder of a tenant's objects under the storage root ('' for the default tenant)."""
    return "" if check_tenant(name) == DEFAULT_TENANT else layout.tenant_root(name)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    tenant: str


class KeyRing:
    """Bearer key -> tenant. Built from a keys file, or from one plain key (`--api-key`: one tenant).

    A keys file is read again on every request (it is small: one read and a hash), and parsed anew when
    its bytes changed, so an edit that keeps the size and the modification time is seen too. It fails
    closed: a file that cannot be read or has a bad line means no key is valid until it is fixed, with
    one ERROR line naming the file and line per change, not per request."""

    def __init__(
        self,
        hashes: dict[str, str],
        path: Path | None = None,
        digest: str | None = None,
        weights: dict[str, float] | None = None,
    ) -> None:
        self._hashes = hashes  # sha256 hex -> tenant
        self._weights = weights or {}  # tenant -> share weight, where the file gives one
        self.path = path
        self._digest = digest  # of the bytes `_hashes` came from
        self._lock = threading.Lock()

    @classmethod
    def single(cls, api_key: str, tenant: str = DEFAULT_TENANT) -> KeyRing:
        return cls({hash_key(api_key): check_tenant(tenant)})

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KeyRing:
        """The keys of `path`; KeysFileError if it cannot be used (a service refuses to start on it)."""
        path = Path(path)
        data = _read(path)
        return cls(parse_keys(path, data), path, _digest(data), parse_weights(path, data))

    def tenants(self) -> list[str]:
        self._reload()
        return sorted(set(self._hashes.values()))

    def weights(self) -> dict[str, float]:
        """The tenants' share weights the file gives (others weigh 1); none while the file is broken."""
        self._reload()
        return dict(self._weights)

    def resolve(self, key: str | None) -> Caller | None:
        """The tenant of this key, or None (no key, or not one of ours)."""
        if not key:
            return None
        self._reload()
        given = hash_key(key)
        for known, tenant in self._hashes.items():  # compare every entry, in constant time each
            if hmac.compare_digest(given, known):
                return Caller(tenant)
        return None

    def _reload(self) -> None:
        if self.path is None:
            return
        with self._lock:
            try:
                data = _read(self.path)
                digest = _digest(data)
            except KeysFileError as exc:
                data, digest, problem = None, f"unreadable: {exc}", exc
            if digest == self._digest:
                return
            self._digest = digest
            try:
                if data is None:
                    raise problem
                self._hashes = parse_keys(self.path, data)
                self._weights = parse_weights(self.path, data)
                log.info("API keys file %s reloaded: %d key(s)", self.path, len(self._hashes))
            except KeysFileError as exc:
                self._hashes, self._weights = {}, {}
                log.error("%s; no API key is accepted until the file is fixed", exc)


def read_keys_file(path: Path) -> dict[str, str]:
    """sha256 hex -> tenant, from the keys file; KeysFileError names the file (and line) of a problem."""
    return parse_keys(path, _read(path))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KeysFileError(f"cannot read API keys file {path}: {exc.strerror or exc}") from None


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def parse_keys(path: Path, data: bytes) -> dict[str, str]:
    """The keys of a keys file's bytes (`path` only names it in errors)."""
    return _parse(path, data, weights=False)


def parse_weights(path: Path, data: bytes) -> dict[str, float]:
    """The `TENANT weight=W` lines of a keys file's bytes: tenant -> weight."""
    return _parse(path, data, weights=True)


def _parse(path: Path, data: bytes, weights: bool) -> dict:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KeysFileError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    hashes: dict[str, str] = {}
    shares: dict[str, float] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) == 2 and fields[1].startswith(WEIGHT_PREFIX):
            tenant, weight = _weight_line(path, number, fields)
            if shares.get(tenant, weight) != weight:
                raise KeysFileError(f"{path}:{number}: a second, different weight for tenant {tenant!r}")
            shares[tenant] = weight
            continue
        if len(fields) != 2 or not _SHA256.match(fields[1]):
            raise KeysFileError(
                f"{path}:{number}: expected 'TENANT KEY_SHA256' (64 lowercase hex digits) or "
                "'TENANT weight=W'; create key entries with `bulkgen keys add TENANT`"
            )
        try:
            hashes[fields[1]] = check_tenant(fields[0])
        except ValueError as exc:
            raise KeysFileError(f"{path}:{number}: {exc}") from None
    return shares if weights else hashes


def _weight_line(path: Path, number: int, fields: list[str]) -> tuple[str, float]:
    try:
        tenant = check_tenant(fields[0])
        return tenant, check_weight(fields[1].removeprefix(WEIGHT_PREFIX), f"tenant {tenant!r}")
    except ValueError as exc:
        raise KeysFileError(f"{path}:{number}: {exc}") from None


def check_weight(text: str, what: str) -> float:
    """A share weight: a number > 0 and at most MAX_WEIGHT (ValueError naming `what` otherwise)."""
    try:
        weight = float(text)
    except ValueError:
        weight = float("nan")
    if not 0 < weight <= MAX_WEIGHT:
        raise ValueError(
            f"the weight of {what} must be a number > 0 and at most {MAX_WEIGHT:g}, got {text[:40]!r}"
        )
    return weight


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


def key_label(key_hash: str) -> str:
    """How a key is named to operators (`keys list`, `keys revoke`): its hash's first 16 hex digits."""
    return f"{HASH_LABEL}{key_hash[:16]}"


def revoke_keys(path: str | os.PathLike[str], which: str) -> list[tuple[str, str]]:
    """Remove from the keys file every key of tenant `which`, or the one key `which` names: `sha256:PREFIX`
    (at least 8 hex digits of its hash, as `keys list` shows it) or the plain key itself. Other lines and
    comments stay; the file is replaced atomically. -> the (tenant, hash) pairs removed."""
    path = Path(path)
    data = _read(path)
    hashes = parse_keys(path, data)  # refuse to rewrite a file we could not read back
    chosen = _chosen(hashes, which)
    gone = {key_hash for _, key_hash in chosen}
    kept = [line for line in data.decode("utf-8").splitlines(keepends=True) if _line_hash(line) not in gone]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return chosen


def _line_hash(line: str) -> str | None:
    fields = line.split("#", 1)[0].split()
    return fields[1] if len(fields) == 2 else None


def _chosen(hashes: dict[str, str], which: str) -> list[tuple[str, str]]:
    if which.startswith(HASH_LABEL):
        prefix = which.removeprefix(HASH_LABEL).lower()
        if not re.fullmatch(r"[0-9a-f]{8,64}", prefix):
            raise ValueError(
                f"{which!r}: give at least 8 hex digits of the key's hash, as `bulkgen keys list` "
                "shows it (sha256:0123abcd...)"
            )
        found = [(t, h) for h, t in hashes.items() if h.startswith(prefix)]
        if len(found) > 1:
            raise ValueError(f"{which!r} matches {len(found)} keys; give more digits")
    elif which.startswith(KEY_PREFIX):
        found = [(t, h) for h, t in hashes.items() if h == hash_key(which)]
    else:
        found = [(t, h) for h, t in hashes.items() if t == which]
    if not found:
        raise ValueError(
            f"no key matches {which[:80]!r}: give a tenant, sha256:PREFIX (see `bulkgen keys list`) "
            "or the key itself"
        )
    return found
