"""A model load's progress, readable from other threads while it runs: a worker answers liveness with it
(runtime/worker.py's `progress`, and its polls), so a worker loading a large checkpoint is seen as alive
and its dispatcher does not take it for lost (Kubernetes' startup probes: liveness is judged only after
the first successful start).

The checkpoint's size (its weight files) is known before any weight is read; tensors and bytes read so
far are counted as transformers materializes each checkpoint tensor (loading.load_model), and an
`s3://` model's copy into the node's cache counts the bytes that have landed. No torch import here.

BULKGEN_TEST_LOAD_DELAY_S (tests only) spreads that many seconds of sleep over the checkpoint's tensor
reads, so a test sees a slow load through the real loading path.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from bulkgen.engine.model.checkpoint_checks import CheckpointError, read_header

LOAD_DELAY_ENV = "BULKGEN_TEST_LOAD_DELAY_S"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


_current: LoadProgress | None = None  # the load under way in this process (one at a time: the worker's)
_delay_lock = threading.Lock()  # the test delay's sleeps one after another, whatever threads read tensors


class LoadProgress:
    """One load: its phase (fetching, reading, building), the checkpoint's size, what is read so far."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.phase = "starting"
        self.started = time.monotonic()
        self.checkpoint_bytes: int | None = None
        self.tensors_total: int | None = None
        self.tensors_done = 0
        self.bytes_done = 0
        self.fetch_dir: Path | None = None  # an object-store model's cache folder while it is copied
        self._lock = threading.Lock()

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def set_checkpoint(self, folder: str | Path) -> None:
        """The local checkpoint is there: its weight files' size and tensor count."""
        self.fetch_dir = None
        self.checkpoint_bytes, self.tensors_total = checkpoint_size(folder)

    def tensor_read(self, nbytes: int) -> None:
        """A checkpoint tensor of `nbytes` (as stored) was read."""
        delay = float(os.environ.get(LOAD_DELAY_ENV) or 0)
        if delay > 0:  # transformers reads on a few threads: the sleeps add up to `delay` all the same
            with _delay_lock:
                time.sleep(delay / max(1, self.tensors_total or 1))
        with self._lock:
            self.tensors_done += 1
            self.bytes_done += nbytes

    def snapshot(self) -> dict:
        """What liveness answers: phase, seconds since the load began, bytes and tensors done of the total."""
        done = self.bytes_done
        if self.fetch_dir is not None:  # copying from object storage: what has landed so far
            done = _folder_bytes(self.fetch_dir)
        return {
            "model": self.model,
            "phase": self.phase,
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "checkpoint_bytes": self.checkpoint_bytes,
            "bytes_done": done,
            "tensors_done": self.tensors_done,
            "tensors_total": self.tensors_total,
        }


def begin(progress: LoadProgress | None) -> None:
    """Make `progress` the load under way (None: no load)."""
    global _current
    _current = progress


def current() -> LoadProgress | None:
    return _current


def checkpoint_size(folder: str | Path) -> tuple[int, int | None]:
    """(bytes of the folder's weight files, tensors in its safetensors files; None if it has other kinds).
    A safetensors file's tensors are counted from its header alone."""
    total, tensors = 0, 0
    counted = True
    for path in sorted(Path(folder).glob("*")):
        if not path.is_file() or not path.name.endswith(WEIGHT_SUFFIXES):
            continue
        total += path.stat().st_size
        if path.name.endswith(".safetensors"):
            tensors += _safetensors_count(path)
        else:
            counted = False
    return total, (tensors if counted and tensors else None)


def _safetensors_count(path: Path) -> int:
    try:
        return len(read_header(path))
    except (OSError, CheckpointError):  # refused, naming why, by the load's own check (checkpoint_checks)
        return 0


def _folder_bytes(folder: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total
