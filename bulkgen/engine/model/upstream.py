"""The releases of the libraries bulkgen reaches into that it was tested with, and the one error for a
release that changed what bulkgen imitates.

bulkgen hands transformers objects of its own where transformers expects its own (hybrid_layers' state
views in place of a cache, an attention function registered through `AttentionInterface`), so a
release that calls a new method on them would break a model at its first step. The tested ranges are
the ones `pyproject.toml` declares (read from the installed package's metadata: one place), and
`tests/engine/test_upstream_interfaces.py` compares each imitation with what the installed release
calls. At load, a release outside the range is said once in the log, and an imitation that lacks what
the release asks for is refused with `UpstreamMismatch`, naming the method and the tested range.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging

log = logging.getLogger(__name__)


class UpstreamMismatch(RuntimeError):
    """The installed release of a library asks for something bulkgen's imitation of its objects lacks."""


@functools.cache
def tested_range(package: str) -> str | None:
    """The version specifier bulkgen's metadata declares for `package` (e.g. '<=5.25.0,>=5.17.0'), or None
    where bulkgen is not installed as a package or does not name it."""
    from packaging.requirements import Requirement

    try:
        requires = importlib.metadata.requires("bulkgen") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in requires:
        req = Requirement(line)
        if req.name == package and req.marker is None:
            return str(req.specifier) or None
    return None


def installed(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def within_tested(package: str) -> bool | None:
    """Whether the installed release is inside the tested range (None where either is unknown)."""
    from packaging.specifiers import SpecifierSet

    spec, version = tested_range(package), installed(package)
    if spec is None or version is None:
        return None
    return SpecifierSet(spec).contains(version, prereleases=True)


def describe(package: str) -> str:
    """'transformers 5.26.0 (bulkgen was tested with >=5.17.0,<=5.25.0)'."""
    spec = tested_range(package)
    tested = f" (bulkgen was tested with {package}{spec})" if spec else ""
    return f"{package} {installed(package) or '(not installed)'}{tested}"


def mismatch(what: str, package: str = "transformers") -> UpstreamMismatch:
    """The refusal for an imitation that lacks `what` the installed release asks for."""
    spec = tested_range(package)
    fix = f"; install a tested release: pip install '{package}{spec}'" if spec else ""
    return UpstreamMismatch(f"{what}: {describe(package)}{fix}")


@functools.cache
def warn_if_untested(package: str = "transformers") -> bool:
    """Log once per process when the installed release is outside the tested range; True if it is."""
    if within_tested(package) is False:
        log.warning(
            "%s: outside the tested range; a model that fails at load names what changed", describe(package)
        )
        return True
    return False
