"""The engine worker's engine thread: it alone owns the engine (and every torch op), admits prepared
requests, steps while anything is held, settles finished requests into their ranges, and isolates a
failing request by bisection after a failed step (see runtime/worker.py's module docstring)."""

from __future__ import annotations

import logging
import os
from collections import deque
from concurrent.futures import Future

from bulkgen.batch.endpoints.completions import merge_results
from bulkgen.batch.outputlines import refused_line
from bulkgen.batch.reasoning import NONE, read_by, read_choices
from bulkgen.batch.special_tokens import keep_markers
from bulkgen.batch.tools import call_markup
from bulkgen.runtime.held import HeldRange, Prepared, echo_of, result_dict, split_step
from bulkgen.runtime.parts import PartEntry

log = logging.getLogger("bulkgen.runtime.worker")
NAME_RANK_WITHIN_S = 2.0  # a lost group's rank 0 waits this long for its follower watch to name a dead rank


class EngineLoop:
    """EngineWorker's engine-thread methods (a mixin over the worker's state, guarded by its `_cond`)."""

    def _on_engine_thread(self, fn):
        """Run `fn` on the engine thread and return its result. Torch work happens on that thread alone: a
        second thread running parallel ops (a model load on an RPC thread) makes a second OpenMP team, and
        libgomp, seeing more threads than cores, stops spinning between parallel regions, so every op of
        every step waits for its threads to wake (steps were ~30% slower in the worker than alone)."""
        task: Future = Future()
        with self._cond:
            self._tasks.append((fn, task))
            self._cond.notify_all()
        return task.result()

    def _engine_loop(self) -> None:
        os_thread_name(f"bg-engine-{self.index}")
        import torch

        if self.cpu_threads:  # OpenMP's thread count is per calling thread: set it where forward runs
            torch.set_num_threads(self.cpu_threads)
        self.torch_threads = torch.get_num_threads()  # what the forward really uses, shown to operators
        while True:
            with self._cond:
                while not (self._aborts or self._tasks or self._has_work()):
                    self._cond.wait(0.5)
                aborts, self._aborts = self._aborts, []
                tasks, self._tasks = list(self._tasks), deque()
            for fn, task in tasks:
                try:
                    task.set_result(fn())
                except BaseException as exc:  # the caller (load) raises it
                    if self._group_lost(exc):  # a rank died while the group loaded: no model error
                        self._die(exc)
                    task.set_exception(exc)
            if self.engine is None:
                continue
            try:
                if aborts and self.engine is not None:
                    self.engine.abort(aborts)
                    with self._cond:
                        for rid in aborts:
                            self._live.pop(rid, None)
                self._admit()
                if self.engine.has_unfinished():
                    self._step()
            except Exception as exc:
                if type(exc).__name__ == "RankLost":  # tensor_parallel.RankLost: the group is gone
                    self._die(exc)
                self._recover(f"{type(exc).__name__}: {exc}")

    def _die(self, exc: Exception) -> None:
        """A rank of this worker's tensor-parallel group died or hung: the whole group is one lost worker.
        The actor exits, so the dispatcher puts its ranges back and the pool removes the group (its other
        ranks' actors and placement group: runtime/groups.py) and places a new one."""
        died = getattr(self.launcher, "died", None)  # which follower, when it is one that died
        named = died(NAME_RANK_WITHIN_S) if died is not None else None
        log.error(
            "worker %d: %s%s; exiting so the group is replaced",
            self.index,
            exc,
            f" ({named})" if named else "",
        )
        os._exit(1)

    def _group_lost(self, exc: BaseException) -> bool:
        """A tensor-parallel load failed because the group lost a rank (tensor_parallel.RankLost: a peer's
        connection closed or its collective timed out), not because a follower's own load raised (its
        watch, runtime/groups.py, saw that first: the model cannot load, and the batch fails as before)."""
        failure = getattr(self.launcher, "failure", None)
        return type(exc).__name__ == "RankLost" and not (failure is not None and failure())

    def _has_work(self) -> bool:
        return self.engine is not None and bool(
            self.engine.has_unfinished() or self._inbox or self._quarantine
        )

    def _admit(self) -> None:
        with self._cond:
            if self._group is not None and not self._live:
                self._group = None  # every suspect of the group settled
            if self._group is not None:
                return  # isolating: nothing new joins the suspects
            if self._quarantine:
                if self._live:
                    return
                self._group = batch = self._quarantine.popleft()
            else:
                batch, self._inbox = list(self._inbox), deque()
            for p in batch:
                self._live[p.request_id] = p
        for p in batch:
            self._add(p)

    def _add(self, p: Prepared) -> None:
        from bulkgen.engine import EmbedParams
        from bulkgen.engine.features.guide import GrammarError

        try:
            params = (
                EmbedParams(**p.params)
                if p.request.embedding is not None
                else self.engine.sampling_params(p.params)
            )
            self.engine.add_request(
                p.request_id, p.prompt_ids, params, tag=p.range_key[0], lora=p.request.lora, images=p.images
            )
        except Exception as exc:  # one request's bad parameters never touch the others
            self.engine.abort([p.request_id])
            code = "invalid_request" if isinstance(exc, ValueError) else "engine_error"
            field = getattr(exc, "field", None)  # SamplingError names the field
            param = f"body.{field}" if isinstance(field, str) else None
            if isinstance(exc, GrammarError) or field == "guide":
                param = p.request.guide_param
            self._fail(p, str(exc), code, param)

    def _step(self) -> None:
        finished = self.engine.step()
        records = self.engine.pop_step_records()
        with self._cond:
            for out in finished:
                p = self._live.pop(out.request_id, None)
                if p is not None and out.error is not None:  # its grammar failed as it ran
                    param = p.request.guide_param
                    self._fail(p, f"{param}: {out.error}", "invalid_parameter", param)
                elif p is not None:
                    self._finish(p, out)
            for record in records:
                self._step_times.add(record["duration_s"])
                self._busy_s += record["duration_s"]
                for batch_id, share in split_step(record).items():
                    owner = self._owner_of.get(batch_id, "")
                    self._steps[owner].setdefault(batch_id, []).append(share)
            if finished:
                self._cond.notify_all()

    def _finish(self, p: Prepared, out) -> None:
        work = self._ranges.get(p.range_key)
        if work is None:
            return  # aborted meanwhile
        result = result_dict(out)
        result["system_fingerprint"] = work.fingerprint or self.engine.system_fingerprint
        if p.request.embedding is None:
            self._read(p.request, result, [c.token_ids for c in out.outputs])
        if p.request.lora is not None:  # the batch's per-adapter counts (BatchMetrics.adapters)
            result["metrics"]["lora"] = p.request.lora
        if p.request.echo:
            echo = echo_of(p.request, p.prompt_ids, self.engine.tokenizer)
            for c in result["completions"]:
                c.update(echo=echo, prompt_logprobs=result["prompt_logprobs"])
        work.metrics.append(result["metrics"])
        if p.parts > 1:  # one prompt of several: the line is done when every prompt is
            done = work.partials.setdefault(p.request.line, {})
            done[p.part] = result
            if len(done) < p.parts:
                return
            result = merge_results([done.pop(k) for k in range(p.parts)], p.params.get("n", 1))
        usage = (
            result["prompt_tokens"],
            result["completion_tokens"],
            result["cached_tokens"],
            result.get("reasoning_tokens", 0),
        )
        entry = PartEntry(p.request.line, True, b"", usage)
        work.answers.append((entry, p.request, result))
        self._settle(work, p.request.line, entry)

    def _read(self, request, result: dict, ids: list[list[int]]) -> None:
        """Read the reasoning out of each choice (and harmony's calls), after decoding again with the markers
        the output is read by kept where the tokenizer has them as special tokens."""
        tokenizer = self.engine.tokenizer
        markers = read_by(request.reasoning_parser) + (
            call_markup(request.tool_format) if request.tools else ()
        )
        if markers:
            keep_markers(result["completions"], ids, markers, tokenizer)
        if request.reasoning_parser not in (None, NONE):
            read_choices(result, ids, request.reasoning_parser, request.reasoning_open, tokenizer)

    def _fail(self, p: Prepared, message: str, code: str, param: str | None = None) -> None:
        with self._cond:
            self._live.pop(p.request_id, None)
            work = self._ranges.get(p.range_key)
            if work is not None:
                envelope = refused_line(p.request.custom_id, message, code, param)
                self._settle(work, p.request.line, PartEntry.of(p.request.line, False, envelope))

    def _settle(self, work: HeldRange, line: int, entry: PartEntry) -> None:
        """Record one request's entry; a range whose every request settled goes to the writer."""
        if work.remaining.pop(line, None) is None:
            return
        work.entries.append(entry)
        if not work.remaining and work.key in self._ranges:
            self._complete(work.key)

    def _complete(self, key: tuple) -> None:
        self._writes.put(self._ranges.pop(key))

    def _recover(self, message: str) -> None:
        """A failed step: reset the engine, then bisect the requests it held until the culprit is alone."""
        log.exception("worker %d: engine step failed", self.index)
        with self._cond:
            suspects, self._live = list(self._live.values()), {}
            self._group = None
        self._reset_engine()
        if len(suspects) == 1:
            self._fail(suspects[0], f"the engine failed on this request: {message}", "engine_error")
            return
        half = len(suspects) // 2
        with self._cond:
            self._quarantine.extendleft([suspects[half:], suspects[:half]])

    def _reset_engine(self) -> None:
        try:
            self.engine.reset()
        except Exception:
            log.exception("worker %d: engine reset failed; rebuilding it", self.index)
            self.engine = type(self.engine)(self.engine.model, self.engine.tokenizer, **self.engine_kwargs)
            self._loras = {}  # a new engine holds no adapters: lines load theirs again


def os_thread_name(name: str) -> None:
    """Name the calling thread for the OS (Linux, 15 bytes), so top, py-spy and /proc tell the engine
    thread from OpenMP's and Ray's; Python 3.11 names its threads only for itself."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
