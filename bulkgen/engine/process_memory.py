"""This process's resident memory from the kernel's own counters: its RSS now and its peak since a reset.

The peak is /proc/self/status's VmHWM after writing 5 to /proc/self/clear_refs (Linux >= 4.0), not
`getrusage().ru_maxrss`: Linux carries a parent's peak into a child's ru_maxrss across fork and exec, so a
process started from a big one (a pytest run, a Ray raylet's worker pool) would read its parent's size.
Elsewhere (no /proc) both fall back to ru_maxrss, the lifetime peak: an upper bound."""

from __future__ import annotations

from pathlib import Path


def reset_peak_rss() -> int:
    """The resident set size now, after restarting the kernel's peak mark at it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # the peak stays the process's lifetime peak
    return _status_bytes("VmRSS")


def peak_rss() -> int:
    """The highest resident set size since the last reset_peak_rss (or the process's start)."""
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
