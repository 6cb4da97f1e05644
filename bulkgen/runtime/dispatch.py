"""The dispatch loop: keep every worker's engine full, collect finished requests, checkpoint chunks.

Each worker holds about two chunks at once, so when one chunk's last request is still decoding the
next chunk's requests already fill the freed slots (continuous batching across chunk boundaries).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import ray

from bulkgen.batch.responses import not_run_line, refused_line, success_line
from bulkgen.runtime import parts

CONTROL_EVERY_S = 1.0
PUBLISH_EVERY_S = 2.0


@dataclass
class ChunkState:
    worker: int
    remaining: set
    entries: list = field(default_factory=list)


class Dispatcher:
    def __init__(self, runner, chunks, items, tally: parts.Tally, model_name: str) -> None:
        self.runner, self.chunks, self.items, self.tally = runner, chunks, items, tally
        self.model_name = model_name
        self.workers = runner.pool.workers
        self.inflight: dict[int, ChunkState] = {}
        self.load = [0] * len(self.workers)
        self.metrics = runner.metrics
        self.capacity = 2 * runner.ctx.settings.chunk_size

    def run(self, todo: deque) -> str | None:
        """Run until all chunks are written; returns a stop reason if cancelled or expired first."""
        batch_id = self.runner.batch_id
        next_control = next_publish = time.monotonic()
        while todo or self.inflight:
            self._fill(todo, batch_id)
            self._collect(ray.get([w.poll.remote(batch_id, 0.2) for w in self.workers]))
            now = time.monotonic()
            if now >= next_control:
                next_control = now + CONTROL_EVERY_S
                stop = self.runner.stop_reason()
                if stop:
                    self._stop(stop)
                    return stop
            if now >= next_publish:
                next_publish = now + PUBLISH_EVERY_S
                self.runner.publish(self._live_tally(), save_metrics=True)
        self._release()
        self.runner.publish(self.tally, save_metrics=True)
        return None

    def _fill(self, todo: deque, batch_id: str) -> None:
        while todo:
            worker = min(range(len(self.workers)), key=self.load.__getitem__)
            if self.load[worker] >= self.capacity:
                return
            chunk = todo.popleft()
            lines = self.chunks[chunk]
            requests = [{"id": f"{batch_id}:{chunk}:{line}", "prompt_token_ids": self.items[line].prompt_token_ids,
                         "params": self.items[line].params} for line in lines]
            self.workers[worker].submit.remote(batch_id, requests)
            self.inflight[chunk] = ChunkState(worker, set(lines))
            self.load[worker] += len(lines)

    def _collect(self, polls: list[dict]) -> None:
        for poll in polls:
            _add_metrics(self.metrics, poll)
            for result in poll["finished"]:
                _, chunk, line = result["request_id"].rsplit(":", 2)
                self._finish(int(chunk), int(line), result)

    def _finish(self, chunk: int, line: int, result: dict) -> None:
        state = self.inflight.get(chunk)
        if state is None or line not in state.remaining:
            return  # a duplicate delivery: results are idempotent per custom_id
        request = self.items[line].request
        if "error" in result:
            envelope = refused_line(request.custom_id, result["error"], result["code"])
            state.entries.append(parts.entry(line, False, envelope))
        else:
            usage = (result["prompt_tokens"], result["completion_tokens"], result["cached_tokens"])
            state.entries.append(parts.entry(line, True, success_line(request.to_dict(), result, self.model_name),
                                             usage))
            self.metrics.add_request(result["metrics"])
        state.remaining.discard(line)
        self.load[state.worker] -= 1
        if not state.remaining:
            self._checkpoint(chunk, state)

    def _checkpoint(self, chunk: int, state: ChunkState) -> None:
        parts.write_part(self.runner.ctx.store, self.runner.batch_id, chunk, state.entries)
        for e in state.entries:
            self.tally.add(e)
        del self.inflight[chunk]

    def _release(self) -> None:
        ray.get([w.release.remote(self.runner.batch_id) for w in self.workers])

    def _live_tally(self) -> parts.Tally:
        """Written parts plus what has finished in chunks not yet written: counts move with every request."""
        live = parts.Tally(**self.tally.__dict__)
        for state in self.inflight.values():
            for e in state.entries:
                live.add(e)
        return live

    def _stop(self, code: str) -> None:
        """Abort in-flight requests, keep what finished, and mark the rest as never run."""
        ids = [f"{self.runner.batch_id}:{c}:{line}" for c, s in self.inflight.items() for line in s.remaining]
        for worker in self.workers:
            worker.abort.remote(ids)
        self._collect(ray.get([w.poll.remote(self.runner.batch_id, 0.0) for w in self.workers]))
        self._release()
        for chunk, state in list(self.inflight.items()):
            for line in sorted(state.remaining):
                state.entries.append(parts.entry(line, False, not_run_line(self.items[line].request.custom_id, code)))
            state.remaining.clear()
            self._checkpoint(chunk, state)



def _add_metrics(metrics, poll: dict) -> None:
    worker = f"bulkgen-worker-{poll['worker']}"
    metrics.add_steps(worker, poll["steps"])
    if poll["stats"]:
        metrics.add_engine_stats(worker, poll["stats"])
