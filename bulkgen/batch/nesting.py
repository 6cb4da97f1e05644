"""A batch line's JSON read with a nesting limit: every value nested deeper than MAX_NESTING is cut out.

Python's json module recurses once per level and raises RecursionError near 1,000 levels, at a depth that
depends on how deep the caller's stack already is, so a 2 KB line of `[[[...]]]` would fail its whole batch
(and could pass validation in one process and fail in another). bulkgen's limit is fixed and far below
that, and generous for real requests: OpenAI's structured outputs allow 10 levels of schema nesting (20
levels of JSON), and a line's envelope adds about 6. A value nested deeper is replaced by a marker before
parsing; the request parser (bulkgen.batch.requests) then refuses that line alone, naming the body field
that held it. Most lines hold fewer brackets than the limit and are parsed directly.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_NESTING = 128  # arrays and objects, the line's own object counting as 1
MARKER = "\x00bulkgen: nested too deep"  # what a cut value reads as after parsing
_MARKER_JSON = json.dumps(MARKER).encode()
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN = frozenset(b"[{")


def load(raw: bytes | str) -> tuple[Any, bool]:
    """(the line's JSON value, whether something nested deeper than MAX_NESTING was cut out of it).
    ValueError (json's, or UnicodeError) for a line that is not JSON."""
    data = raw.encode() if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= MAX_NESTING or _deepest(data) <= MAX_NESTING:
        return json.loads(raw), False
    return json.loads(_cut(data)), True


def holds_marker(value: Any) -> bool:
    """Whether a cut-out value is somewhere inside `value` (a parsed, limited value: walked without
    recursion all the same)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if item == MARKER:
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _deepest(data: bytes) -> int:
    """The deepest nesting of `data`'s arrays and objects (brackets inside strings do not count)."""
    depth = deepest = 0
    for bracket in _STRING.sub(b"", data).translate(None, _NOT_BRACKETS):
        depth += 1 if bracket in _OPEN else -1
        deepest = max(deepest, depth)
    return deepest


def _cut(data: bytes) -> bytes:
    """`data` with each value that opens at level MAX_NESTING + 1 replaced by the marker. A line whose
    brackets never close again is cut short, so json then refuses it as it would the whole line."""
    pieces, depth, kept = [], 0, 0
    for token in _TOKEN.finditer(data):
        first = data[token.start()]
        if first == ord('"'):
            continue
        if first in _OPEN:
            depth += 1
            if depth == MAX_NESTING + 1:
                pieces.append(data[kept : token.start()])
            continue
        if depth == MAX_NESTING + 1:
            pieces.append(_MARKER_JSON)
            kept = token.end()
        depth -= 1
    if depth <= MAX_NESTING:
        pieces.append(data[kept:])
    return b"".join(pieces)
