"""A real LocalStore whose chosen calls a test can hold at a gate, to interleave writers deterministically.

    store = GatedStore(path)
    gate = store.gate("write", r"batches/.*\\.json")   # the first matching write waits at the gate
    ...                                                # start the writer in a thread
    gate.wait_reached()                                # it is now held, before anything is written
    gate.open()                                        # let it through (later matching calls pass)

`on_miss` is called when a read finds no object (before NotFound reaches the caller), and `calls`
counts each operation per key prefix, so a test can wait for a manager's next scan.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable

from bulkgen.store import LocalStore, NotFound


class Gate:
    def __init__(self, op: str, pattern: str) -> None:
        self.op, self.pattern = op, re.compile(pattern)
        self.reached = threading.Event()
        self.opened = threading.Event()
        self.passed = threading.Event()  # a held call went on and returned

    def matches(self, op: str, key: str) -> bool:
        return op == self.op and bool(self.pattern.fullmatch(key))

    def wait_reached(self, timeout: float = 60.0) -> None:
        assert self.reached.wait(timeout), f"nothing reached the gate {self.op} {self.pattern.pattern}"

    def open(self) -> None:
        self.opened.set()


class GatedStore(LocalStore):
    def __init__(self, root, **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.gates: list[Gate] = []
        self.calls: Counter[tuple[str, str]] = Counter()
        self.on_miss: Callable[[str], None] | None = None
        self._lock = threading.Lock()

    def gate(self, op: str, pattern: str) -> Gate:
        gate = Gate(op, pattern)
        self.gates.append(gate)
        return gate

    def _hold(self, op: str, key: str) -> list[Gate]:
        with self._lock:  # a gate holds the first call that matches it, and only that one
            self.calls[(op, key)] += 1
            held = [g for g in self.gates if g.matches(op, key) and not g.reached.is_set()]
            for gate in held:
                gate.reached.set()
        for gate in held:
            assert gate.opened.wait(120), f"gate {op} {key} never opened"
        return held

    def write_bytes(self, key, data, *, if_match=None, if_none_match=False):
        held = self._hold("write", key)
        try:
            return super().write_bytes(key, data, if_match=if_match, if_none_match=if_none_match)
        finally:
            for gate in held:
                gate.passed.set()

    def delete(self, key):
        held = self._hold("delete", key)
        try:
            return super().delete(key)
        finally:
            for gate in held:
                gate.passed.set()

    def read_versioned(self, key):
        self._hold("read", key)
        try:
            return super().read_versioned(key)
        except NotFound:
            if self.on_miss is not None:
                self.on_miss(key)
            raise

    def list(self, prefix, *, start_after=None):
        self._hold("list", prefix)
        return super().list(prefix, start_after=start_after)
