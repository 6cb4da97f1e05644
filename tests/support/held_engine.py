"""An engine a test holds mid-batch: the real Engine on a real (tiny) model, whose marked requests wait at a
gate until the test opens it, so a cancel, kill or expiry test catches a batch in progress for as long as
it needs, instead of making its batch long enough to outlast the test on a fast machine.

    def test_cancel(client, engine_gate):   # the fixture closes the gate, and opens it when the test ends
        rows = [chat_row("long-0", f"{HOLD} story", max_tokens=64), chat_row("short-0", "label")]
        ...create the batch...
        engine_gate.wait_held()             # a worker holds the marked requests now
        ...cancel / kill / expire: they are still in progress; or engine_gate.open() to let them finish

Held requests step along with unheld ones in the same engine, so give them more tokens than the unheld
requests beside them take steps.

Workers build this class when BULKGEN_TEST_ENGINE names it (bulkgen.engine.engine_class). tests/conftest.py
sets that, and BULKGEN_TEST_GATE (a folder), for the whole session before anything starts Ray, so every
worker (in Ray actors and in `bulkgen serve` / `bulkgen watch` subprocesses) inherits both. While the gate
is closed (the file `closed` is in that folder), an engine whose unfinished requests all carry HOLD in
their prompt takes no step: they stay in progress, aborts still reach them, and they run on once the gate
opens. Unmarked requests are never held, so every other test runs on the plain engine's behaviour.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bulkgen.engine.engine import Engine
from tests.support.wait import wait_until

HOLD = "[hold]"  # in a prompt: the request waits at the gate
GATE_ENV = "BULKGEN_TEST_GATE"


class HeldEngine(Engine):
    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        """The plain load; each one is recorded in the gate folder's `loads` file (a line per load: pid,
        path), so a test counts how many times workers loaded a model (tests/runtime/test_slow_load.py)."""
        with open(Path(os.environ[GATE_ENV]) / "loads", "a") as f:
            f.write(f"{os.getpid()} {path}\n")
        return super().from_pretrained(path, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        self._held: set[str] = set()

    def add_request(self, request_id, prompt, params, tag=None, lora=None, images=None) -> None:
        super().add_request(request_id, prompt, params, tag, lora=lora, images=images)
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        if HOLD in text:
            self._held.add(request_id)

    def step(self):
        self._held &= self.requests.keys()  # finished and aborted requests leave the set
        if self.requests and self._held == self.requests.keys() and _gate().closed():
            _gate().mark_held()
            time.sleep(0.01)  # the worker calls step() again at once: this spaces its checks of the gate
            return []
        return super().step()


class EngineGate:
    """The test's side of the gate: close, wait until a worker holds marked requests, open."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def closed(self) -> bool:
        return (self.folder / "closed").exists()

    def close(self) -> None:
        (self.folder / "held").unlink(missing_ok=True)
        (self.folder / "closed").touch()

    def open(self) -> None:
        (self.folder / "closed").unlink(missing_ok=True)

    def mark_held(self) -> None:
        (self.folder / "held").touch()

    def wait_held(self, timeout: float = 120) -> None:
        """Until some worker holds its marked requests at the closed gate (all it has left are those)."""
        wait_until(lambda: (self.folder / "held").exists(), timeout, "an engine to hold requests at the gate")


def _gate() -> EngineGate:
    return EngineGate(os.environ[GATE_ENV])
