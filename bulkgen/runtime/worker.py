"""An engine worker: one continuous-batching engine per GPU (or CPU actor), fed without pauses.

Runners submit requests in chunks and poll for finished ones; a background thread owns the engine and
keeps stepping while anything is queued, so the batch stays full across chunk boundaries. Results are
kept per group (a batch id), so several runners may share the workers without taking each other's
results. The class is plain Python (testable without Ray); `bulkgen.runtime.pool` makes it an actor.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import defaultdict
from typing import Any

from bulkgen.models.registry import resolve_model_path

log = logging.getLogger(__name__)


class EngineWorker:
    def __init__(self, index: int, engine_kwargs: dict[str, Any] | None = None, cpu_threads: int | None = None):
        self.index = index
        self.engine_kwargs = dict(engine_kwargs or {})
        self.cpu_threads = cpu_threads
        self.engine = None
        self.model_name: str | None = None
        self.model_path: str | None = None
        self.endpoint_url: str | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._group_of: dict[str, str] = {}
        self._finished: dict[str, list[dict]] = defaultdict(list)
        self._steps: list[dict] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"bulkgen-engine-{index}", daemon=True)
        self._thread.start()

    def load(self, model_name: str, model_path: str, endpoint_url: str | None = None) -> dict[str, Any]:
        """Load (or keep) the model; returns what the worker runs on. Call it while the worker is idle.

        An `s3://` model is copied to this node's cache by the worker itself, so workers on other
        nodes of a cluster load it too; `endpoint_url` is the storage's S3 endpoint."""
        if self.model_name != model_name or self.engine is None:
            self.model_name, self.model_path, self.endpoint_url = model_name, model_path, endpoint_url
            self._build_engine()
        return self.info()

    def info(self) -> dict[str, Any]:
        device = str(getattr(self.engine, "device", "unloaded"))
        return {"index": self.index, "model": self.model_name, "device": device, "pid": os.getpid()}

    def submit(self, group: str, requests: list[dict[str, Any]]) -> None:
        """`requests`: {"id", "prompt_token_ids", "params": SamplingParams kwargs}; ids unique per worker."""
        with self._cond:
            self._group_of.update((r["id"], group) for r in requests)
        self._inbox.put(("add", requests))

    def abort(self, request_ids: list[str]) -> None:
        with self._cond:
            for request_id in request_ids:
                self._group_of.pop(request_id, None)
        self._inbox.put(("abort", request_ids))

    def poll(self, group: str, timeout: float = 0.5) -> dict[str, Any]:
        """The group's requests finished since its last poll (waits up to `timeout` for one)."""
        with self._cond:
            if not self._finished.get(group):
                self._cond.wait(timeout)
            finished = self._finished.pop(group, [])
            steps, self._steps = self._steps, []
        stats = self.engine.stats() if self.engine is not None else {}
        return {"finished": finished, "steps": steps, "stats": stats, "worker": self.index}

    def release(self, group: str) -> None:
        """The group's runner is done: forget anything of it still here."""
        with self._cond:
            self._finished.pop(group, None)
            stale = [rid for rid, g in self._group_of.items() if g == group]
        if stale:
            self.abort(stale)

    # -- the engine thread -------------------------------------------------------------------------
    def _build_engine(self) -> None:
        import torch

        from bulkgen.engine import Engine

        if self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        self.engine = None
        self.engine = Engine.from_pretrained(resolve_model_path(self.model_path, endpoint_url=self.endpoint_url),
                                             **self.engine_kwargs)

    def _loop(self) -> None:
        while True:
            busy = self.engine is not None and self.engine.has_unfinished()
            try:
                self._drain(block=not busy)
                if self.engine is not None and self.engine.has_unfinished():
                    self._step()
            except Exception as exc:
                self._recover(f"{type(exc).__name__}: {exc}")

    def _recover(self, message: str) -> None:
        """An engine failure fails the requests it held (each gets the reason), then a fresh engine
        takes over, so one bad step never wedges the worker or loses a request silently."""
        log.exception("worker %d: engine failed", self.index)
        with self._cond:
            held = list(self._group_of)
        self._publish([{"request_id": rid, "error": f"engine failed: {message}", "code": "engine_error"}
                       for rid in held], [])
        try:
            self._build_engine()
        except Exception:
            log.exception("worker %d: could not rebuild the engine", self.index)
            self.engine = None

    def _drain(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, kind: str, payload: list) -> None:
        if self.engine is None:  # no engine: refuse what arrives, never crash the loop
            if kind == "add":
                self._publish([{"request_id": r["id"], "error": "the worker has no model loaded",
                                "code": "engine_error"} for r in payload], [])
            return
        if kind == "abort":
            self.engine.abort(payload)
            return
        from bulkgen.engine import SamplingParams

        refused = []
        for request in payload:
            try:
                self.engine.add_request(request["id"], request["prompt_token_ids"], SamplingParams(**request["params"]))
            except ValueError as exc:
                refused.append({"request_id": request["id"], "error": str(exc), "code": "invalid_request"})
        if refused:
            self._publish(refused, [])

    def _step(self) -> None:
        outputs = self.engine.step()
        self._publish([result_dict(o) for o in outputs], self.engine.pop_step_records())

    def _publish(self, finished: list[dict], steps: list[dict]) -> None:
        with self._cond:
            for result in finished:
                group = self._group_of.pop(result["request_id"], None)
                if group is not None:  # None: aborted or released meanwhile
                    self._finished[group].append(result)
            self._steps.extend(steps)
            if finished:
                self._cond.notify_all()


def result_dict(output) -> dict[str, Any]:
    """A finished RequestOutput as plain data for the runner (no tensors cross the actor boundary)."""
    metrics = output.metrics
    return {
        "request_id": output.request_id,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": sum(len(c.token_ids) for c in output.outputs),
        "cached_tokens": metrics.num_cached_tokens,
        "completions": [
            {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": c.logprobs}
            for c in output.outputs
        ],
        "metrics": metrics.as_dict(),
        "finished_at": time.time(),
    }
