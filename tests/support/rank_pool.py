"""Tensor-parallel follower ranks kept for the whole test session (the `rank_pool` fixture).

tensor_parallel.ProcessLauncher starts a fresh interpreter per follower and per model; importing torch and
transformers there is most of a tiny model's two-rank test (about 4 s idle, 15 s and more on a busy
machine). A placed group's follower actors (runtime/groups.py) instead serve every model their rank 0
loads, one after another, in the same process: this launcher does the same with kept interpreters of this
machine, so the engine tests' many two-rank engines pay that start once. Each kept interpreter serves one
model at a time (tensor_parallel.serve_rank, as RankActor.serve calls it); the pool keeps one spare idle, so
an engine built while another's model is open finds a rank whose imports are done.

What a test of the group's faults needs (a follower that dies or hangs, killed by its pid, and how rank 0
sees that) stays with ProcessLauncher's fresh processes, whose ends are what those tests observe; so do
the tests that measure a rank's memory while it loads, which a process that served other models first
would blur.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import traceback

from bulkgen.engine.parallel.tensor_parallel import ProcessLauncher

_DONE, _FAILED = "done", "failed"  # a kept rank's answer per model, one line each


class RankPool(ProcessLauncher):
    """tensor_parallel.Launcher whose followers are kept interpreters (KeptRank), reused across models."""

    def __init__(self, ready: int = 1) -> None:
        self.ranks = [KeptRank() for _ in range(ready)]  # started now: their imports overlap the first load
        self.lock = threading.Lock()

    def start(self, specs: list[dict]) -> list[Serving]:
        """Serve `specs` on idle kept ranks (started when too few are idle), then start a spare when none
        is left idle: the next engine, while this one's model is open (a module's fixture keeps it), finds
        one whose imports are done."""
        with self.lock:
            idle = [rank for rank in self.ranks if rank.idle()]
            while len(idle) < len(specs):
                self.ranks.append(KeptRank())
                idle.append(self.ranks[-1])
            serving = [rank.serve(spec) for rank, spec in zip(idle, specs, strict=False)]
            if len(idle) == len(specs):
                self.ranks.append(KeptRank())
            return serving

    def close(self) -> None:
        for rank in self.ranks:
            rank.stop()
        for rank in self.ranks:
            rank.end()


class KeptRank:
    """One kept follower interpreter: it reads a serve_rank spec per line on its stdin and answers one line
    per model when serve_rank returns (`done`) or raises (`failed`)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.current: Serving | None = None
        threading.Thread(target=self._read, name="bulkgen-kept-rank", daemon=True).start()

    def idle(self) -> bool:
        return self.process.poll() is None and (self.current is None or self.current.ended.is_set())

    def serve(self, spec: dict) -> Serving:
        self.current = Serving(self.process)
        self.process.stdin.write(json.dumps(spec) + "\n")
        self.process.stdin.flush()
        return self.current

    def stop(self) -> None:
        """No more specs: the interpreter exits once the model it serves, if any, ends."""
        try:
            self.process.stdin.close()
        except OSError:  # it died
            pass

    def end(self, timeout: float = 10) -> None:
        """Wait for the stopped interpreter to exit, or kill it (a model whose rank 0 never closed it)."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _read(self) -> None:
        for line in self.process.stdout:
            if self.current is not None:
                self.current.end(line.strip())
        self.process.wait()
        if self.current is not None:  # the interpreter ended: the model it served ends with it
            self.current.ended.set()


class Serving:
    """A kept rank's serve of one model (tensor_parallel.Follower). It reads as the process a fresh follower
    would be: running until serve_rank returns (exit code 0) or raises (1, as a fresh interpreter's
    traceback ends it), or the interpreter's own code when it died."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.pid = process.pid
        self.ended = threading.Event()
        self.code: int | None = None

    def end(self, answer: str) -> None:
        self.code = 0 if answer == _DONE else 1
        self.ended.set()

    def poll(self) -> int | None:
        if self.code is not None:
            return self.code
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.process.args, timeout)
        return self.poll()

    def kill(self) -> None:
        """Nothing to end, as a follower actor's (runtime/groups.py): the interpreter stays for the next
        model, and this serve returns once rank 0 abandons the model (tensor_parallel.launch)."""


def _serve_forever() -> None:
    """The kept interpreter's loop: serve each spec read from stdin until stdin closes. Its stdout is the
    answers' channel alone; anything the model code prints goes to stderr."""
    from bulkgen.engine.model_runner import ModelRunner  # noqa: F401  (imported before the first spec)
    from bulkgen.engine.parallel.tensor_parallel import serve_rank

    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    for line in sys.stdin:
        try:
            serve_rank(**json.loads(line))
            answers.write(_DONE + "\n")
        except Exception:
            traceback.print_exc()
            answers.write(_FAILED + "\n")
    sys.stderr.flush()
    os._exit(0)  # nothing left to run: skip the interpreter's teardown of torch and its threads


if __name__ == "__main__":
    _serve_forever()
