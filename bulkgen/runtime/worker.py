"""An engine worker: one continuous-batching engine per GPU (or CPU actor), fed by pulling line ranges.

The driver's dispatcher long-polls `poll()`, which says how many more requests the engine has room
for (`want`, from its free slots and its waiting queue, which grows when KV blocks run out), which
ranges finished since the last poll (their parts are already in storage), and this worker's engine
steps split per batch. `assign()` hands it ranges: the worker reads their bytes from storage, applies
the chat template, tokenizes and fits the context, and queues them for the engine thread, which owns
the engine and keeps stepping while anything is held. A writer thread stores each finished range's
result part, so storage latency never stalls a step.

A step that raises resets the engine and isolates the culprit by bisection: the requests it held are
re-run in halves, alone, until the one that fails by itself is reported as `engine_error`; the rest
finish normally, and no other batch is touched. The class is plain Python (testable without Ray);
`bulkgen.runtime.pool` makes it an actor.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from bulkgen.batch.requests import LineError, ParsedRequest, custom_id_of, parse_line
from bulkgen.batch.responses import json_line, merge_results, not_run_line, refused_line, success_line
from bulkgen.engine.stats import StepTimes
from bulkgen.models.registry import resolve_model_path
from bulkgen.runtime.lineindex import read_lines
from bulkgen.runtime.parts import PartEntry, Tally, write_part
from bulkgen.runtime.prepare import fit_context, split_prompts, tokenize
from bulkgen.runtime.ranges import RangeBounds, RangeOutcome
from bulkgen.runtime.workqueue import QueuedBatch, model_key
from bulkgen.store import StorageUnavailable, open_store

log = logging.getLogger(__name__)

# A driver that has not polled for this long is gone (its process or its head died): parts of its ranges
# are no longer stored, so a service restarted on the same storage can finalize without this worker
# writing after it (the runner that takes the batch over waits this out: bulkgen.runtime.lease).
ORPHAN_AFTER_S = 10.0


@dataclass
class Prepared:
    request_id: str
    range_key: tuple
    request: ParsedRequest
    prompt_ids: list[int]
    params: dict[str, Any]
    part: int = 0  # a completions line with several prompts runs one engine request per prompt:
    parts: int = 1  # this is prompt `part` of `parts`


@dataclass
class HeldRange:
    """A range assigned to this worker: what of it is still running, and the entries of what finished."""

    bounds: RangeBounds
    model: str
    store: Any
    remaining: dict[int, str] = field(default_factory=dict)  # line -> custom_id
    entries: list[PartEntry] = field(default_factory=list)
    # successes whose output line the writer thread encodes, off the step loop: entry, request, engine result
    answers: list[tuple[PartEntry, ParsedRequest, dict]] = field(default_factory=list)
    metrics: list[dict] = field(default_factory=list)
    partials: dict[int, dict[int, dict]] = field(default_factory=dict)  # line -> prompt part -> its result

    @property
    def batch_id(self) -> str:
        return self.bounds.batch_id

    @property
    def key(self) -> tuple:
        return self.bounds.key

    def outcome(self) -> RangeOutcome:
        tally = Tally()
        for e in self.entries:
            tally.add(e)
        return RangeOutcome(self.bounds, tally, self.metrics)


class EngineWorker:
    def __init__(
        self, index: int, engine_kwargs: dict[str, Any] | None = None, cpu_threads: int | None = None
    ):
        self.index = index
        self.engine_kwargs = dict(engine_kwargs or {})
        self.cpu_threads = cpu_threads
        self._stores: dict[str, Any] = {}
        self.engine = None
        self.model_name: str | None = None
        self.model_key: str | None = None
        self._cond = threading.Condition()
        self._prepare_lock = threading.Lock()
        self._ranges: dict[tuple, HeldRange] = {}
        self._live: dict[str, Prepared] = {}  # in the engine
        self._inbox: deque[Prepared] = deque()  # prepared, not yet in the engine
        self._aborts: list[str] = []
        self._preparing = 0
        self._stopped: set[str] = set()
        self._owner_of: dict[str, str] = {}  # batch id -> the driver that assigned it
        self._polled: dict[str, float] = {}  # driver -> when it last polled (monotonic)
        self._done: dict[str, list[dict]] = defaultdict(list)  # per driver
        self._steps: dict[str, dict[str, list[dict]]] = defaultdict(dict)  # per driver, per batch
        self._quarantine: deque[list[Prepared]] = deque()
        self._group: list[Prepared] | None = None  # the suspects in the engine while isolating a failure
        self._writes: queue.Queue = queue.Queue()
        self._load_lock = threading.Lock()  # a load the dispatcher asks for waits for one under way
        self._tasks: deque = deque()  # (fn, Future): torch work other threads hand the engine thread
        self.node_ip = _node_ip()
        self.torch_threads: int | None = None  # set by the engine thread
        self._step_times = StepTimes()  # the loaded engine's step wall times, reported by poll
        threading.Thread(target=self._engine_loop, name=f"bulkgen-engine-{index}", daemon=True).start()
        threading.Thread(target=self._write_loop, name=f"bulkgen-writer-{index}", daemon=True).start()

    # -- the driver's calls --------------------------------------------------------------------------
    def load(self, model_name: str, model_path: str, endpoint_url: str | None = None) -> dict[str, Any]:
        """Load (or keep) the model; the dispatcher switches models only while the worker holds nothing.

        An `s3://` model is copied to this node's cache by the worker itself, so workers on other
        nodes of a cluster load it too; `endpoint_url` is the storage's S3 endpoint."""
        with self._load_lock:
            if self.model_key != model_key(model_name, model_path) or self.engine is None:
                from bulkgen.engine import engine_class

                with self._cond:
                    self.engine, self.model_name, self.model_key = None, None, None
                path = resolve_model_path(model_path, endpoint_url=endpoint_url)
                engine = self._on_engine_thread(
                    lambda: engine_class().from_pretrained(path, **self.engine_kwargs)
                )
                with self._cond:
                    self.engine, self.model_name = engine, model_name
                    self._step_times = StepTimes()
                    self.model_key = model_key(model_name, model_path)
                    self._cond.notify_all()
        return self.info()

    def info(self) -> dict[str, Any]:
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        device = str(next(self.engine.model.parameters()).device) if self.engine is not None else "unloaded"
        return {
            "index": self.index,
            "model": self.model_name,
            "device": device,
            "pid": os.getpid(),
            "node": node,
            "node_ip": self.node_ip,
        }

    def assign(self, batch: QueuedBatch, ranges: list[RangeBounds], owner: str = "") -> None:
        """Read, prepare and queue ranges of one batch. `owner` names the driver that assigned them:
        several drivers (service replicas, a `bulkgen run`) may share a worker, and each polls only its
        own results."""
        with self._cond:
            if batch.batch_id in self._stopped:
                return
            self._owner_of[batch.batch_id] = owner
            self._preparing += sum(b.size for b in ranges)
        with self._prepare_lock:
            for bounds in ranges:
                self._prepare_range(batch, bounds)

    def poll(self, owner: str = "", timeout: float = 0.5, for_work: bool = True) -> dict[str, Any]:
        """`owner`'s finished ranges and step records by batch, and how many more requests the engine
        wants. Waits up to `timeout` for something to report: a finished range, or (with `for_work`)
        room in the engine; a driver with nothing to hand out polls without `for_work`, so its polls
        do not spin against a worker that is busy stepping. `step_time`: the engine's whole steps since
        its model loaded (count, mean, p50, p90 wall ms), to compare with the engine alone."""
        deadline = time.monotonic() + timeout
        with self._cond:  # woken by every step that finishes a request: wait on, unless there is news
            self._polled[owner] = time.monotonic()
            while not self._done.get(owner) and not (for_work and self._want() > 0):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            done = self._done.pop(owner, [])
            steps = self._steps.pop(owner, {})
            return {
                "worker": self.index,
                "node_ip": self.node_ip,
                "threads": self.torch_threads,
                "model": self.model_key,
                "done": done,
                "steps": steps,
                "step_time": self._step_times.summary(),  # whole steps, whatever batches shared them
                "progress": self._progress(owner),
                "want": self._want(),
                "spare": self._spare(),
                "held": len(self._live) + len(self._inbox) + self._preparing,
            }

    def abort_batch(self, batch_id: str, code: str | None) -> int:
        """Stop the batch's work here. With `code` (batch_cancelled / batch_expired) each of its ranges
        gets its part now: what finished, and `code` for the rest; without, nothing is written (the
        lease moved elsewhere). Returns after every part of the batch is stored."""
        with self._cond:
            self._stopped.add(batch_id)
            mine = {k: r for k, r in self._ranges.items() if r.batch_id == batch_id}
            for key in mine:
                del self._ranges[key]
            self._aborts += [rid for rid, p in self._live.items() if p.range_key in mine]
            self._inbox = deque(p for p in self._inbox if p.range_key not in mine)
            self._quarantine = deque([p for p in g if p.range_key not in mine] for g in self._quarantine)
            self._cond.notify_all()
        self._writes.join()  # parts of its ranges that finished just before
        if code:
            for work in mine.values():
                work.entries += [
                    PartEntry.of(line, False, not_run_line(cid, code)) for line, cid in work.remaining.items()
                ]
                self._store_part(work)
        return len(mine)

    def forget(self, batch_id: str) -> None:
        """The batch ended: drop its stop mark (ids are unique, so it would never be seen again)."""
        with self._cond:
            self._stopped.discard(batch_id)
            self._owner_of.pop(batch_id, None)

    # -- preparation (RPC threads) --------------------------------------------------------------------
    def _prepare_range(self, batch: QueuedBatch, bounds: RangeBounds) -> None:
        work = HeldRange(bounds, batch.model, self._store(batch.store))
        key = work.key
        ready: list[Prepared] = []
        try:
            lines = list(read_lines(work.store, batch.input_key, bounds.first_line, bounds.start, bounds.end))
        except Exception as exc:  # storage failed: hand the range back to the driver, never hang it
            if isinstance(exc, StorageUnavailable):
                log.warning("worker %d: could not read %s: %s", self.index, key, exc)
            else:
                log.exception("worker %d: could not read %s", self.index, key)
            with self._cond:
                self._preparing -= bounds.size
                error = f"{type(exc).__name__}: {exc}"
                self._done[self._owner_of.get(batch.batch_id, "")].append(
                    RangeOutcome(bounds, error=error, storage_down=isinstance(exc, StorageUnavailable))
                )
                self._cond.notify_all()
            return
        for line, raw in lines:
            try:
                request = parse_line(raw, line, batch.endpoint)
            except LineError as err:  # a body error (validation counted the line and indexed it), or a line
                # validated under looser rules: refuse the line alone
                custom_id = custom_id_of(raw)
                work.remaining[line] = custom_id
                refused = refused_line(custom_id, err.message, err.code, err.param)
                self._settle(work, line, PartEntry.of(line, False, refused))
                continue
            work.remaining[line] = request.custom_id
            subs = split_prompts(request)
            try:
                ready += [
                    self._prepared(f"{batch.batch_id}|{line}", key, sub, k, len(subs))
                    for k, sub in enumerate(subs)
                ]
            except LineError as err:
                refused = refused_line(request.custom_id, err.message, err.code, err.param)
                self._settle(work, line, PartEntry.of(line, False, refused))
        with self._cond:
            self._preparing -= bounds.size
            if batch.batch_id in self._stopped:
                return
            self._ranges[key] = work
            self._inbox.extend(ready)
            if not work.remaining:
                self._complete(key)
            self._cond.notify_all()

    def _prepared(
        self, request_id: str, key: tuple, request: ParsedRequest, part: int, count: int
    ) -> Prepared:
        ids = tokenize(request, self.engine.tokenizer)
        params = fit_context(request, len(ids), self.engine.max_model_len)
        return Prepared(
            request_id if count == 1 else f"{request_id}|{part}", key, request, ids, params, part, count
        )

    # -- the engine thread ------------------------------------------------------------------------------
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
                self._recover(f"{type(exc).__name__}: {exc}")

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
        from bulkgen.engine import EmbedParams, SamplingParams

        try:
            params = (
                EmbedParams(**p.params) if p.request.embedding is not None else SamplingParams(**p.params)
            )
            self.engine.add_request(p.request_id, p.prompt_ids, params, tag=p.range_key[0])
        except Exception as exc:  # one request's bad parameters never touch the others
            self.engine.abort([p.request_id])
            code = "invalid_request" if isinstance(exc, ValueError) else "engine_error"
            field = getattr(exc, "field", None)  # SamplingError names the field
            self._fail(p, str(exc), code, f"body.{field}" if isinstance(field, str) else None)

    def _step(self) -> None:
        finished = self.engine.step()
        records = self.engine.pop_step_records()
        with self._cond:
            for out in finished:
                p = self._live.pop(out.request_id, None)
                if p is not None:
                    self._finish(p, out)
            for record in records:
                self._step_times.add(record["duration_s"])
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
        usage = (result["prompt_tokens"], result["completion_tokens"], result["cached_tokens"])
        entry = PartEntry(p.request.line, True, b"", usage)
        work.answers.append((entry, p.request, result))
        self._settle(work, p.request.line, entry)

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

    # -- the writer thread ----------------------------------------------------------------------------
    def _write_loop(self) -> None:
        os_thread_name(f"bg-writer-{self.index}")
        while True:
            work = self._writes.get()
            try:
                if self._store_until_done(work):
                    with self._cond:
                        self._done[self._owner_of.get(work.batch_id, "")].append(work.outcome())
                        self._cond.notify_all()
            except Exception:  # the range is not reported done, so the driver will hand it out again
                log.exception("worker %d: could not store a part of %s", self.index, work.batch_id)
            finally:
                self._writes.task_done()

    def _store_until_done(self, work: HeldRange) -> bool:
        """Storage down: keep the results and try again (the part write is idempotent) until it answers
        or the batch is withdrawn from this worker (its runner gave up; a resumed one redoes the range)."""
        delay = 0.5
        while True:
            if self._orphaned(work):
                return False
            try:
                self._store_part(work)
                return True
            except StorageUnavailable as exc:
                log.warning("worker %d: part of %s not stored yet: %s", self.index, work.batch_id, exc)
            with self._cond:
                if work.batch_id in self._stopped:
                    return False
            time.sleep(delay)
            delay = min(delay * 2, 10.0)

    def _orphaned(self, work: HeldRange) -> bool:
        """True when the driver of `work` stopped polling ORPHAN_AFTER_S ago: its part is not stored. The
        range is handed back (no attempt used) in case that driver was only slow and polls again."""
        with self._cond:
            owner = self._owner_of.get(work.batch_id, "")
            last = self._polled.get(owner)
            if last is None or time.monotonic() - last < ORPHAN_AFTER_S:
                return False
            self._done[owner].append(
                RangeOutcome(work.bounds, error="its driver stopped polling", storage_down=True)
            )
        log.warning(
            "worker %d: driver %s silent for %.0f s; part %s-%s of %s not stored",
            self.index,
            owner or "-",
            time.monotonic() - last,
            work.bounds.first_line,
            work.bounds.last_line,
            work.batch_id,
        )
        return True

    def _store(self, spec: dict[str, Any]):
        key = json.dumps(spec, sort_keys=True)
        if key not in self._stores:
            self._stores[key] = open_store(**spec)
        return self._stores[key]

    def _store_part(self, work: HeldRange) -> None:
        for entry, request, result in work.answers:
            entry.envelope = json_line(success_line(request, result, work.model))
        work.answers.clear()
        write_part(work.store, work.batch_id, work.bounds.first_line, work.bounds.last_line, work.entries)

    def _progress(self, owner: str) -> dict[str, dict[str, int]]:
        """Requests settled in ranges not yet written, per batch: so counts move with every request."""
        out: dict[str, dict[str, int]] = {}
        for work in self._ranges.values():
            if self._owner_of.get(work.batch_id, "") == owner and work.entries:
                counts = out.setdefault(work.batch_id, {"completed": 0, "failed": 0})
                for e in work.entries:
                    counts["completed" if e.ok else "failed"] += 1
        return out

    # -- capacity ------------------------------------------------------------------------------------
    def _want(self) -> int:
        """Requests to pull now: enough to keep one full batch running and one waiting for admission
        (so the scheduler can sort by length), none while the engine is KV-bound or isolating a crash.
        Room is reported in steps of half a batch, so work arrives in whole ranges, not one by one."""
        if self.engine is None:
            return 0 if self.model_name else 1
        if self._group is not None or self._quarantine:
            return 0
        capacity = self.engine.free_capacity()
        slots = capacity["max_num_seqs"]
        if capacity["waiting"] >= slots or (capacity["waiting"] and not capacity["free_blocks"]):
            return 0
        room = 2 * slots - len(self._live) - len(self._inbox) - self._preparing
        return room if room >= max(1, slots // 2) else 0

    def _spare(self) -> int:
        """Requests of a batch new to this worker that it takes even when `want` is 0, up to half an engine
        load beyond its usual hold: the engine admits fairly between batches, so they start within a few
        steps instead of after the worker-load of another batch held ahead of them."""
        if self.engine is None or self._group is not None or self._quarantine:
            return 0
        slots = self.engine.config.max_num_seqs
        return max(0, slots * 5 // 2 - len(self._live) - len(self._inbox) - self._preparing)


def _node_ip() -> str | None:
    """This worker's node address, for operators (dashboard, log lines); None outside Ray."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        # the address the node registered with (what `ray status` shows), not this host's default route's
        return (
            getattr(ray._private.worker.global_worker, "node_ip_address", None)
            or ray.util.get_node_ip_address()
        )
    except Exception:
        return None


def os_thread_name(name: str) -> None:
    """Name the calling thread for the OS (Linux, 15 bytes), so top, py-spy and /proc tell the engine
    thread from OpenMP's and Ray's; Python 3.11 names its threads only for itself."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def split_step(record: dict) -> dict[str, dict]:
    """One engine step record as each batch's share: its own slots and tokens, and the step time in
    proportion to its tokens, so batches sharing a worker never count each other's work."""
    by_tag = record.get("by_tag") or {}
    total = sum(t["prefill_tokens"] + t["decode_tokens"] for t in by_tag.values()) or 1
    held_all = record.get("num_seqs") or 1
    out = {}
    for tag, t in by_tag.items():
        out[tag] = {
            "t": record["t"],
            "duration_s": record["duration_s"] * (t["prefill_tokens"] + t["decode_tokens"]) / total,
            "num_seqs": t["held"],
            "active_seqs": t["active"],
            "prefill_tokens": t["prefill_tokens"],
            "decode_tokens": t["decode_tokens"],
            "output_tokens": t.get("output_tokens", 0),
            "padding_slots": round(record.get("padding_slots", 0) * t["held"] / held_all),
            "max_num_seqs": record.get("max_num_seqs"),
            "batch_size": record.get("num_seqs", t["held"]),
        }
    return out


def result_dict(output) -> dict[str, Any]:
    """A finished RequestOutput as plain data (no tensors cross the actor boundary). Usage counts every
    generated token, those of best_of candidates that were not returned included (the engine's metrics)."""
    metrics = output.metrics
    returned = sum(len(c.token_ids) for c in output.outputs)
    return {
        "request_id": output.request_id,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": max(returned, metrics.num_output_tokens),
        "cached_tokens": metrics.num_cached_tokens,
        "completions": [
            {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": c.logprobs}
            for c in output.outputs
        ]
        if output.embedding is None
        else [{"index": 0, "embedding": output.embedding}],
        "prompt_logprobs": getattr(output, "prompt_logprobs", None),
        "metrics": metrics.as_dict(),
        "finished_at": time.time(),
    }


def echo_of(request: ParsedRequest, prompt_ids: list[int], tokenizer) -> dict[str, str]:
    """What `echo` puts before a completion: the prompt as written (token prompts decoded) and its first
    token, which the prompt logprobs do not cover."""
    text = request.prompt if isinstance(request.prompt, str) else tokenizer.decode(prompt_ids)
    return {"text": text, "first_token": tokenizer.decode(prompt_ids[:1])}
