"""Ids that sort newest-first as plain strings, so listings page through storage keys in order."""

from __future__ import annotations

import secrets
import time

_MAX_MS = 0xFFFFFFFFFFFF  # 12 hex digits of milliseconds: good for ~8,900 years


def new_id(prefix: str) -> str:
    """`prefix` + inverted millisecond clock + randomness: lexicographic order is newest first."""
    inverted = _MAX_MS - int(time.time() * 1000)
    return f"{prefix}{inverted:012x}{secrets.token_hex(6)}"


def random_id(prefix: str) -> str:
    """An opaque id where order does not matter (request ids, completion ids)."""
    return f"{prefix}{secrets.token_hex(12)}"
