"""Served LoRA adapters: names a line's `body.model` may give besides the served models, each on one base.

An adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`), local or under an
object-store URL, attached to one served model, its base: the one `--lora NAME=PATH@BASE` names, else the
served model whose name or path the adapter's `base_model_name_or_path` gives, else the only served model.
The driver side (validation, /v1/models, the runner) reads only `adapter_config.json`; each worker fetches
the weights into its own cache and loads them into its engine when a line first names the adapter.

`--lora` flags are resolved once, at start: a flag that cannot be served stops the service with one line
naming it. The adapters file (`--lora-file`, one `NAME=PATH[@BASE]` per line) is read again whenever its
bytes change, so adapters are added to a running service by editing it (docs/lora.md says why a file and
not an admin route); an entry that cannot be served there is skipped with one ERROR line per change,
and the others stay served.

An adapter may be scoped to tenants (`NAME=PATH[@BASE] tenants=T1,T2`, in a flag or a file line): only
those tenants' lines may run it and only they see it in /v1/models; to every other tenant it does not
exist (the same `model_not_found` as a name nothing serves). An adapter without `tenants=` is served to all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from bulkgen.store import layout

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
_SCOPE = re.compile(r"^(?P<spec>.*?)\s+tenants=(?P<tenants>\S*)\s*$")


class AdapterError(ValueError):
    """An adapter that cannot be served: the message names the flag or file line, and why."""


@dataclass(frozen=True)
class LoraSpec:
    """An adapter as the user wrote it: `NAME=PATH` or `NAME=PATH@BASE`."""

    name: str
    path: str  # a local folder, file://…, or s3://… (fetched by each worker into its cache)
    base: str | None = None  # the served model it attaches to; None: from its adapter_config.json
    tenants: frozenset[str] | None = None  # who may run it; None: every tenant


@dataclass(frozen=True)
class Adapter:
    """A servable adapter: its name, where its folder is, the served model it runs on, and the tenants
    that may run it (None: every tenant)."""

    name: str
    path: str
    base: str
    tenants: frozenset[str] | None = None

    def serves(self, tenant: str | None) -> bool:
        """Whether `tenant` may run (and see) this adapter; None: the runtime itself, which sees all."""
        return tenant is None or self.tenants is None or tenant in self.tenants


def parse_lora_spec(spec: str, where: str = "--lora") -> LoraSpec:
    """`NAME=PATH[@BASE]`, optionally followed by ` tenants=T1,T2`; AdapterError names `where` (the flag,
    or the file and line)."""
    tenants = None
    scoped = _SCOPE.match(spec.strip())
    if scoped:
        tenants = _tenants(scoped["tenants"], spec, where)
        spec = scoped["spec"]
    name, sep, rest = spec.strip().partition("=")
    path, at, base = rest.rpartition("@")
    if not at:
        path, base = rest, ""
    if not sep or not name.strip() or not path.strip() or (at and not base.strip()):
        raise AdapterError(f"{where} {spec[:200]!r}: expected NAME=PATH or NAME=PATH@BASE [tenants=T1,T2]")
    return LoraSpec(name.strip(), path.strip(), base.strip() or None, tenants)


def _tenants(value: str, spec: str, where: str) -> frozenset[str]:
    names = [t for t in value.split(",") if t]
    if not names:
        raise AdapterError(f"{where} {spec[:200]!r}: tenants= names no tenant (tenants=T1,T2)")
    for name in names:
        if not re.fullmatch(layout.TENANT_PATTERN, name):
            raise AdapterError(
                f"{where} {spec[:200]!r}: tenant name {name[:80]!r} is not valid: use 1-63 lowercase letters, "
                "digits, '-' or '_', starting with a letter or digit"
            )
    return frozenset(names)


def parse_lora_specs(specs: Iterable[str]) -> dict[str, LoraSpec]:
    """Repeated `--lora` flags -> name -> spec; a name given twice is an error."""
    out: dict[str, LoraSpec] = {}
    for raw in specs:
        spec = parse_lora_spec(raw)
        if spec.name in out:
            raise AdapterError(f"--lora {raw[:200]!r}: the name {spec.name!r} is given twice")
        out[spec.name] = spec
    return out


def resolve_adapter(
    spec: LoraSpec, models: Mapping[str, str], endpoint_url: str | None = None, where: str = "--lora"
) -> Adapter:
    """The adapter with its base found; AdapterError (naming `where` and the adapter) if it cannot be
    served: its name is a served model's, its config cannot be read, or no served model is its base."""
    head = f"{where} {spec.name}={spec.path}"
    if spec.name in models:
        raise AdapterError(f"{head}: {spec.name!r} is already a served model's name")
    if spec.base is not None:
        if spec.base not in models:
            raise AdapterError(
                f"{head}@{spec.base}: no served model is named {spec.base!r} ({_names(models)})"
            )
        return Adapter(spec.name, spec.path, spec.base, spec.tenants)
    try:
        named = read_adapter_config(spec.path, endpoint_url).get("base_model_name_or_path")
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{head}: {exc}") from None
    base = _base_named(named, models)
    if base is None:
        said = f"names base {named!r}" if named else "names no base (base_model_name_or_path)"
        raise AdapterError(
            f"{head}: its {ADAPTER_CONFIG} {said}, which is none of the served models ({_names(models)}); "
            f"write {spec.name}={spec.path}@BASE"
        )
    return Adapter(spec.name, spec.path, base, spec.tenants)


def read_adapter_config(path: str, endpoint_url: str | None = None) -> dict:
    """The adapter folder's adapter_config.json, local or from the object store (that one file only)."""
    if "://" not in path or path.startswith("file://"):
        data = (Path(path.removeprefix("file://")) / ADAPTER_CONFIG).read_bytes()
    else:
        from bulkgen.store import NotFound, open_store

        try:
            data = open_store(path, endpoint_url=endpoint_url).read_bytes(ADAPTER_CONFIG)
        except NotFound:
            raise FileNotFoundError(f"no {ADAPTER_CONFIG} under {path}") from None
    try:
        config = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{ADAPTER_CONFIG} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{ADAPTER_CONFIG} is not a JSON object")
    return config


def _base_named(named: object, models: Mapping[str, str]) -> str | None:
    """The served model the adapter's `base_model_name_or_path` names (by name, or by the path it is
    served from); else the only served model; else None."""
    if isinstance(named, str) and named:
        for name, path in models.items():
            if named == name or _same_path(named, path):
                return name
    return next(iter(models)) if len(models) == 1 else None


def _same_path(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _names(models: Mapping[str, str]) -> str:
    return "served: " + ", ".join(sorted(models))


class AdapterCatalog:
    """Every served adapter: the resolved `--lora` flags, then the adapters file's entries as it is now.

    `--lora` flags are resolved here, so building the catalog is the start-up check (AdapterError). The
    file is re-read on every call whose caller wants the current list, and parsed anew only when its bytes
    changed; a flag's name wins over a file entry of the same name."""

    def __init__(
        self,
        specs: Mapping[str, LoraSpec],
        models: Mapping[str, str],
        path: str | None = None,
        endpoint_url: str | None = None,
    ) -> None:
        self.models, self.endpoint_url = dict(models), endpoint_url
        self._fixed = {name: resolve_adapter(spec, models, endpoint_url) for name, spec in specs.items()}
        self.path = Path(path) if path else None
        self._digest: str | None = None
        self._from_file: dict[str, Adapter] = {}
        self._lock = threading.Lock()
        if self.path is not None and not self.path.is_file():
            raise AdapterError(
                f"--lora-file {self.path}: no such file (create it empty to add adapters later)"
            )
        self._reload()

    def adapters(self, tenant: str | None = None) -> dict[str, Adapter]:
        """name -> adapter, every one served now to `tenant` (None: every one, to any tenant)."""
        self._reload()
        return {name: a for name, a in {**self._from_file, **self._fixed}.items() if a.serves(tenant)}

    def of_base(self, base: str, tenant: str | None = None) -> dict[str, str]:
        """The adapters of one served model that `tenant` may run: name -> path (what a worker needs to
        load them)."""
        return {a.name: a.path for a in self.adapters(tenant).values() if a.base == base}

    def _reload(self) -> None:
        if self.path is None:
            return
        with self._lock:
            try:
                data: bytes | None = self.path.read_bytes()
                digest = hashlib.sha256(data).hexdigest()
            except OSError as exc:
                data, digest = None, f"unreadable: {exc}"
            if digest == self._digest:
                return
            self._digest = digest
            if data is None:
                self._from_file = {}
                log.error("adapters file %s: %s; none of its adapters is served", self.path, digest)
            else:
                self._from_file = self._parse(data)
                log.info("adapters file %s read: %d adapter(s)", self.path, len(self._from_file))

    def _parse(self, data: bytes) -> dict[str, Adapter]:
        found: dict[str, Adapter] = {}
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            where = f"{self.path}:{number}:"
            try:
                spec = parse_lora_spec(line, where)
                if spec.name in found or spec.name in self._fixed:
                    raise AdapterError(f"{where} the name {spec.name!r} is given twice")
                found[spec.name] = resolve_adapter(spec, self.models, self.endpoint_url, where)
            except AdapterError as exc:
                log.error("%s; that adapter is not served until the line is fixed", exc)
        return found
