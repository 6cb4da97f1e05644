"""Ids that sort newest-first as plain strings, so listings page through storage keys in order."""

from __future__ import annotations

import secrets
import time

_MAX_MS = 0xFFFFFFFFFFFF  # 12 hex digits of milliseconds: good for ~8,900 years


def new_id(prefix: str, now: float | None = None) -> str:
    """`prefix` + inverted millisecond clock + randomness: lexicographic order is newest first."""
    inverted = _MAX_MS - int((time.time() if now is None else now) * 1000)
    return f"{prefix}{inverted:012x}{secrets.token_hex(6)}"


def id_time(object_id: str) -> float | None:
    """When a `new_id` id was made (seconds since the epoch), or None for an id of another shape."""
    try:
        return (_MAX_MS - int(object_id[-24:-12], 16)) / 1000
    except ValueError:
        return None


def random_id(prefix: str) -> str:
    """An opaque id where order does not matter (request ids, completion ids)."""
    return f"{prefix}{secrets.token_hex(12)}"
