"""An engine worker: one continuous-batching engine per GPU (or CPU actor), fed without pauses.

The runner submits requests in chunks and polls for finished ones; a background thread owns the engine
and keeps stepping while anything is queued, so the batch stays full across chunk boundaries.
The class is plain Python (testable without Ray); `bulkgen.runtime.pool` wraps it as a Ray actor.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

from bulkgen.models.registry import resolve_model_path


class EngineWorker:
    def __init__(self, index: int, engine_kwargs: dict[str, Any] | None = None, cpu_threads: int | None = None):
        self.index = index
        self.engine_kwargs = dict(engine_kwargs or {})
        self.cpu_threads = cpu_threads
        self.engine = None
        self.model_name: str | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._finished: list[dict] = []
        self._steps: list[dict] = []
        self._error: str | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"bulkgen-engine-{index}", daemon=True)
        self._thread.start()

    def load(self, model_name: str, model_path: str) -> dict[str, Any]:
        """Load (or keep) the model; returns what the worker runs on. Must be called while idle."""
        if self.model_name != model_name:
            import torch

            from bulkgen.engine import Engine

            if self.cpu_threads:
                torch.set_num_threads(self.cpu_threads)
            self.engine = None
            self.engine = Engine.from_pretrained(resolve_model_path(model_path), **self.engine_kwargs)
            self.model_name = model_name
        return self.info()

    def info(self) -> dict[str, Any]:
        device = str(getattr(self.engine, "device", "unloaded"))
        return {"index": self.index, "model": self.model_name, "device": device, "pid": os.getpid()}

    def submit(self, requests: list[dict[str, Any]]) -> None:
        """`requests`: {"id", "prompt_token_ids", "params": SamplingParams kwargs}."""
        self._inbox.put(("add", requests))

    def abort(self, request_ids: list[str]) -> None:
        self._inbox.put(("abort", request_ids))

    def poll(self, timeout: float = 0.5) -> dict[str, Any]:
        """Finished requests since the last poll (waits up to `timeout` for at least one)."""
        with self._cond:
            if not self._finished and self._error is None:
                self._cond.wait(timeout)
            finished, self._finished = self._finished, []
            steps, self._steps = self._steps, []
            error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"worker {self.index} engine failed: {error}")
        stats = self.engine.stats() if self.engine is not None else {}
        return {"finished": finished, "steps": steps, "stats": stats, "worker": self.index}

    # -- the engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            busy = self.engine is not None and self.engine.has_unfinished()
            try:
                self._drain(block=not busy)
                if self.engine is not None and self.engine.has_unfinished():
                    self._step()
            except Exception as exc:  # reach the runner once; the next load() builds a fresh engine
                with self._cond:
                    self._error = f"{type(exc).__name__}: {exc}"
                    self.engine, self.model_name = None, None
                    self._cond.notify_all()

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
        if self.engine is None:  # a failed engine: refuse its leftovers, never crash the loop
            if kind == "add":
                self._publish([{"request_id": r["id"], "error": "the worker's engine is not loaded"}
                               for r in payload], [])
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
                refused.append({"request_id": request["id"], "error": str(exc)})
        if refused:
            self._publish(refused, [])

    def _step(self) -> None:
        outputs = self.engine.step()
        finished = [result_dict(o) for o in outputs]
        self._publish(finished, self.engine.pop_step_records())

    def _publish(self, finished: list[dict], steps: list[dict]) -> None:
        with self._cond:
            self._finished.extend(finished)
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
