"""Tiny models built once per test session, keyed by builder and config (the `tiny_model` fixture).

The architecture matrix, the tensor-parallel matrices, the vision and hybrid tests and the service's
fixtures ask for the same few (family, seed) models; each is written once, into the session's temporary
folder, and every later request gets the same folder. The folders are shared, so a test that writes into
a model's folder (adds files, rewrites weights) builds its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bulkgen.lab.tiny import build_tiny_model


class TinyModels:
    def __init__(self, root: Path):
        self.root = root
        self.built: dict[tuple, Path] = {}

    def __call__(
        self, arch: str = "llama", *, seed: int = 0, builder: Callable = build_tiny_model, **config
    ) -> Path:
        """The folder of `builder(path, arch, seed=seed, **config)`, built on the first request only."""
        key = (builder.__module__, builder.__qualname__, arch, seed, repr(sorted(config.items())))
        if key not in self.built:
            self.built[key] = Path(
                builder(self.root / f"{len(self.built)}-{arch}", arch, seed=seed, **config)
            )
        return self.built[key]
