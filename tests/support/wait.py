"""Waiting on a condition with a deadline: how tests wait, instead of sleeping "long enough"."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    *,
    interval: float = 0.02,
    check: Callable[[], None] | None = None,
    details: Callable[[], str] | None = None,
) -> T:
    """The first truthy value of `predicate()`, polled every `interval` s; AssertionError naming `what` after
    `timeout` s. `check()` runs between polls and may fail early (a process died); `details()` adds context."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if check is not None:
            check()
        if time.monotonic() > deadline:
            extra = f"\n{details()}" if details is not None else ""
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{extra}")
        time.sleep(interval)  # the polling interval of this wait, not a guess at how long anything takes
