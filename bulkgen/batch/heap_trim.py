"""Handing the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere nothing). Memory
Python or Pillow frees stays in glibc's per-thread arenas, resident under whatever is allocated next: a
decoded image's pixels in the worker (batch/images.py), validation's custom_id table in the driver
(runtime/validation.py), ranges' buffers in a long-lived process (runtime/manager.py, runtime/part_writer.py).
"""

from __future__ import annotations

import time

TRIM_EVERY_S = 30.0  # a long-lived process's threads hand free pages back this often (PeriodicTrim)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing). Pillow
    allocates an image in 16 MiB blocks, under glibc's mmap threshold once it has adapted, so a decoded
    image's memory comes from the heap arena of the thread that decoded it, and freed it stays there: with
    4 decoding threads, 7000x7000 images decoded one at a time left the worker 2.7 GB larger, each
    thread's arena holding what its largest decode took. Trimmed after each large line, the worker's RSS
    follows the budget."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class PeriodicTrim:
    """`trim_heap` at most once every `every_s` seconds, for a long-lived process's threads: what they free
    (validation's custom_id table, finalize's merge windows, a worker's range buffers) goes back to glibc's
    per-thread arenas and can stay resident there under whatever is allocated next (issue 49: ~110 bytes a
    request after validation). `now=True`: trim now (a batch just ended)."""

    def __init__(self, every_s: float = TRIM_EVERY_S) -> None:
        self.every_s = every_s
        self._at = time.monotonic()

    def __call__(self, now: bool = False) -> None:
        if now or time.monotonic() - self._at >= self.every_s:
            self._at = time.monotonic()
            trim_heap()


_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            _LIBC.append(libc if hasattr(libc, "malloc_trim") else None)
        except OSError:  # not glibc (macOS, musl)
            _LIBC.append(None)
    return _LIBC[0]
