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

A model or LoRA adapter refused at load (a broken checkpoint: engine/model/checkpoint_checks.py; a refused
adapter: engine/features/lora.py) is remembered per name, path and version of its files: later lines and batches
naming it fail at once as `model_not_loaded` (400) without loading it again, and its ranges finish (their
lines refused) instead of going back to the queue to be halved. Messages name the model or adapter and the
file within it, never a server path.
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
from typing import Any

from bulkgen.batch.heap_trim import PeriodicTrim, trim_heap
from bulkgen.batch.image_budget import TRIM_AFTER_BYTES, ImageBudget
from bulkgen.batch.images import (
    Probed,
    check_images,
    check_line_cost,
    check_model_takes_images,
    start_decoding,
    start_reading,
)
from bulkgen.batch.outputlines import not_run_line, refused_line
from bulkgen.batch.prepare import fit_context, split_prompts, tokenize, tokenize_with_images
from bulkgen.batch.requests import LineError, ParsedRequest, custom_id_of, parse_line, pick_adapter
from bulkgen.engine import heap
from bulkgen.engine.config import EngineConfig
from bulkgen.engine.model import load_progress
from bulkgen.engine.model.checkpoint_checks import CheckpointError
from bulkgen.engine.model.fingerprint import with_template_options
from bulkgen.engine.model.load_progress import LoadProgress
from bulkgen.engine.stats import StepTimes
from bulkgen.models.loras import ADAPTER_CONFIG
from bulkgen.models.registry import fetch_folder, model_cache_folder, resolve_model_path
from bulkgen.runtime import node_ip
from bulkgen.runtime.engine_loop import EngineLoop
from bulkgen.runtime.held import HeldRange, Prepared
from bulkgen.runtime.lineindex import read_lines
from bulkgen.runtime.part_writer import PartWriter
from bulkgen.runtime.parts import PartEntry
from bulkgen.runtime.ranges import RangeBounds, RangeOutcome
from bulkgen.runtime.workqueue import QueuedBatch, model_key
from bulkgen.settings import ImageSettings
from bulkgen.store import StorageUnavailable, open_store

log = logging.getLogger(__name__)


class EngineWorker(EngineLoop, PartWriter):
    """The actor: the driver's calls, range preparation (RPC threads) and capacity; the engine thread's
    loop is EngineLoop's (runtime/engine_loop.py), the writer thread's PartWriter's (runtime/part_writer.py)."""

    def __init__(
        self,
        index: int,
        engine_config: EngineConfig | None = None,
        cpu_threads: int | None = None,
        images: ImageSettings | None = None,
        launcher=None,
    ):
        """`engine_config`: the settings of the engines this worker builds (WorkerSettings.engine_config).
        `launcher`: how a tensor-parallel engine's follower ranks start (runtime/groups.py's actors of
        this worker's placed group); None starts them as processes (tensor_parallel.ProcessLauncher)."""
        self.index = index
        self.launcher = launcher
        self.image_policy = images or ImageSettings()  # what load_images may read, and how much
        # the bytes of images being decoded and processed and of pixel tensors not yet freed (image_budget.py)
        self.image_budget = ImageBudget(self.image_policy.image_memory_bytes)
        self.engine_config = engine_config or EngineConfig()
        self.cpu_threads = cpu_threads
        self._stores: dict[str, Any] = {}
        self.engine = None
        self.model_name: str | None = None
        self.model_key: str | None = None
        self._loras: dict[str, str] = {}  # LoRA adapters in the loaded engine: name -> the path it came from
        # (name, path, version of its files) -> why it could not be loaded: never tried again
        self._lora_failed: dict[tuple[str, str, str], str] = {}
        self._model_refused: dict[tuple[str, str], str] = {}  # (model key, version) -> why (a bad checkpoint)
        self._versions: dict[str, str] = {}  # path -> version, read once per range (_prepare_range)
        self._cond = threading.Condition()
        self._prepare_lock = threading.Lock()
        self._ranges: dict[tuple, HeldRange] = {}
        self._live: dict[str, Prepared] = {}  # in the engine
        self._inbox: deque[Prepared] = deque()  # prepared, not yet in the engine
        self._aborts: list[str] = []
        self._preparing = 0
        self._preparing_of: dict[str, int] = defaultdict(int)  # batch id -> its assign calls under way
        self._forgotten: set[str] = set()  # stopped batches forgotten while an assign of theirs was under way
        self._stopped: set[str] = set()
        self._owner_of: dict[str, str] = {}  # batch id -> the driver that assigned it
        self._polled: dict[str, float] = {}  # driver -> when it last polled (self.clock)
        self.clock = time.monotonic  # when drivers polled, for the writer's orphan rule (tests move it)
        self._done: dict[str, list[dict]] = defaultdict(list)  # per driver
        self._steps: dict[str, dict[str, list[dict]]] = defaultdict(dict)  # per driver, per batch
        self._quarantine: deque[list[Prepared]] = deque()
        self._group: list[Prepared] | None = None  # the suspects in the engine while isolating a failure
        self._writes: queue.Queue = queue.Queue()
        self._trim = PeriodicTrim()  # the writer thread hands free heap pages back (part_writer.py)
        self._load_lock = threading.Lock()  # a load the dispatcher asks for waits for one under way
        self._tasks: deque = deque()  # (fn, Future): torch work other threads hand the engine thread
        self.node_ip = node_ip()
        self.torch_threads: int | None = None  # set by the engine thread
        self._step_times = StepTimes()  # the loaded engine's step wall times, reported by poll
        self._busy_s = 0.0  # seconds this worker's engine spent stepping, whatever batches (or none) it held
        self._ranks: list[dict] | None = None  # a tensor-parallel engine's ranks, reported by poll
        self._loading: LoadProgress | None = None  # the load under way, reported by poll and progress
        self._loads = 0  # loads this actor finished: its dispatcher's poll deadline applies after the first
        threading.Thread(target=self._engine_loop, name=f"bulkgen-engine-{index}", daemon=True).start()
        threading.Thread(target=self._write_loop, name=f"bulkgen-writer-{index}", daemon=True).start()

    # -- the driver's calls --------------------------------------------------------------------------
    def load(self, model_name: str, model_path: str, endpoint_url: str | None = None) -> dict[str, Any]:
        """Load (or keep) the model; the dispatcher switches models only while the worker holds nothing.

        An `s3://` model is copied to this node's cache by the worker itself, so workers on other
        nodes of a cluster load it too; `endpoint_url` is the storage's S3 endpoint."""
        with self._load_lock:
            if self.model_key != model_key(model_name, model_path) or self.engine is None:
                refused = (model_key(model_name, model_path), folder_version(model_path))
                if refused in self._model_refused:  # refused before: at once, the loaded engine kept
                    raise CheckpointError(self._model_refused[refused])

                with self._cond:
                    old, self.engine, self.model_name, self.model_key = self.engine, None, None, None
                if old is not None:  # its tensor-parallel ranks stop (follower actors then serve the next)
                    self._on_engine_thread(old.close)
                del old
                heap.thaw()  # the dropped engine's cycles become collectable (heap.py)
                progress = self._loading = LoadProgress(model_name)
                load_progress.begin(progress)
                try:
                    engine = self._load_engine(progress, model_path, endpoint_url)
                except CheckpointError as exc:
                    log.error(
                        "worker %d: model %s at %s refused: %s", self.index, model_name, model_path, exc
                    )
                    self._model_refused[refused] = str(exc)
                    raise
                finally:
                    load_progress.begin(None)
                    self._loading = None
                heap.freeze_loaded()  # no full collection walks the loaded model during steps (heap.py)
                ranks = self._rank_table(engine)
                with self._cond:
                    self._ranks = ranks
                    self.engine, self.model_name = engine, model_name
                    self._loras, self._lora_failed = {}, {}
                    self._step_times = StepTimes()
                    self.model_key = model_key(model_name, model_path)
                    self._loads += 1
                    self._cond.notify_all()
        return self.info()

    def _load_engine(self, progress: LoadProgress, model_path: str, endpoint_url: str | None):
        """The engine of the checkpoint at `model_path`, copied first if it is in object storage; each
        step is reported in `progress` (what liveness answers meanwhile)."""
        from bulkgen.engine import engine_class

        if "://" in model_path and not model_path.startswith("file://"):
            progress.set_phase("fetching")
            progress.fetch_dir = model_cache_folder(model_path)
        path = resolve_model_path(model_path, endpoint_url=endpoint_url)
        progress.set_checkpoint(path)
        progress.set_phase("reading")
        return self._on_engine_thread(
            lambda: engine_class().from_pretrained(path, self.engine_config, launcher=self.launcher)
        )

    def progress(self) -> dict[str, Any]:
        """Liveness, answered at once whatever the worker does: the load under way (its phase, seconds,
        checkpoint bytes, bytes and tensors read so far; None when none) and how many loads finished."""
        loading = self._loading
        return {
            "worker": self.index,
            "loading": loading.snapshot() if loading is not None else None,
            "loads": self._loads,
            "model": self.model_key,
        }

    def _rank_table(self, engine) -> list[dict] | None:
        """A tensor-parallel engine's ranks for the dashboard: each one's pid, device and load memory, and
        for a placed group its node and GPUs; None for a single-process engine."""
        ranks = engine.runner.ranks
        if ranks.world == 1:
            return None
        memory = ranks.rank_memory()
        return self.launcher.ranks(memory) if hasattr(self.launcher, "ranks") else memory

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
            self._preparing_of[batch.batch_id] += 1
        try:
            with self._prepare_lock:
                for bounds in ranges:
                    self._prepare_range(batch, bounds)
        finally:
            with self._cond:
                self._preparing_of[batch.batch_id] -= 1
                if not self._preparing_of[batch.batch_id]:
                    del self._preparing_of[batch.batch_id]
                    if batch.batch_id in self._forgotten:  # its stop mark outlived the preparation
                        self._forgotten.discard(batch.batch_id)
                        self._stopped.discard(batch.batch_id)

    def poll(self, owner: str = "", timeout: float = 0.5, for_work: bool = True) -> dict[str, Any]:
        """`owner`'s finished ranges and step records by batch, and how many more requests the engine
        wants. Waits up to `timeout` for something to report: a finished range, or (with `for_work`)
        room in the engine; a driver with nothing to hand out polls without `for_work`, so its polls
        do not spin against a worker that is busy stepping. `step_time`: the engine's whole steps since
        its model loaded (count, mean, p50, p90 wall ms), to compare with the engine alone."""
        deadline = time.monotonic() + timeout
        with self._cond:  # woken by every step that finishes a request: wait on, unless there is news
            self._polled[owner] = self.clock()
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
                "ranks": self._ranks,
                "progress": self._progress(owner),
                "loading": self._loading.snapshot() if self._loading is not None else None,
                "loads": self._loads,
                "want": self._want(),
                "spare": self._spare(),
                "held": len(self._live) + len(self._inbox) + self._preparing,
                "busy_s": self._busy_s,  # every step since the worker started, of any batch or driver
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
        """The batch ended: drop its stop mark (ids are unique, so it would never be seen again), but only
        once no assign of it is still preparing lines: a cancelled batch's range being tokenized when the
        batch ended would otherwise find no stop mark and run in full, for no one."""
        with self._cond:
            if self._preparing_of.get(batch_id):
                self._forgotten.add(batch_id)
            else:
                self._stopped.discard(batch_id)
            self._owner_of.pop(batch_id, None)

    # -- preparation (RPC threads) --------------------------------------------------------------------
    def _prepare_range(self, batch: QueuedBatch, bounds: RangeBounds) -> None:
        work = HeldRange(bounds, batch.model, self._store(batch.store))
        work.fingerprint = with_template_options(self.engine.system_fingerprint, batch.template_options)
        self._versions = {}  # adapters' file versions are read afresh once per range
        key = work.key
        counted = [bounds.size]  # lines still counted in _preparing (each leaves it once queued or refused)
        try:
            lines = list(read_lines(work.store, batch.input_key, bounds.first_line, bounds.start, bounds.end))
            parsed = self._parse_lines(batch, work, lines)
            with self._cond:
                if batch.batch_id in self._stopped:
                    self._preparing -= counted[0]
                    return
                self._ranges[key] = work  # registered now: each line goes to the engine once it is prepared
            self._prepare_lines(batch, work, parsed, counted)
        except Exception as exc:  # storage failed (the lines, or an image they name), or preparing a line
            # did: hand the range back to the driver, never hang it (it halves a range that fails again)
            if isinstance(exc, StorageUnavailable):
                log.warning("worker %d: could not read %s: %s", self.index, key, exc)
            else:
                log.exception("worker %d: could not prepare %s", self.index, key)
            with self._cond:
                self._drop_range(key)
                self._preparing -= counted[0]
                error = f"{type(exc).__name__}: {exc}"
                self._done[self._owner_of.get(batch.batch_id, "")].append(
                    RangeOutcome(bounds, error=error, storage_down=isinstance(exc, StorageUnavailable))
                )
                self._cond.notify_all()
            return
        with self._cond:
            self._preparing -= counted[0]
            if key in self._ranges and not work.remaining:
                self._complete(key)
            self._cond.notify_all()

    def _drop_range(self, key: tuple) -> None:
        """A range whose preparation failed, under the lock: its lines already queued or running are dropped
        (the driver reruns the whole range), and nothing of it is written."""
        self._ranges.pop(key, None)
        running = [rid for rid, p in self._live.items() if p.range_key == key]
        for rid in running:
            del self._live[rid]
        self._aborts += running
        self._inbox = deque(p for p in self._inbox if p.range_key != key)
        self._quarantine = deque([p for p in g if p.range_key != key] for g in self._quarantine)

    def _parse_lines(
        self, batch: QueuedBatch, work: HeldRange, lines: list
    ) -> list[tuple[int, ParsedRequest]]:
        """Every line parsed (and a text model's image lines refused); a LineError refuses its line alone."""
        parsed = []
        for line, raw in lines:
            if batch.batch_id in self._stopped:
                return []  # stopped while this range was read or prepared: its lines never reach the engine
            try:
                request = self._parse(raw, line, batch)
                work.remaining[line] = request.custom_id
                if request.images and not getattr(self.engine, "accepts_images", False):
                    # a text model refuses images after validation's own checks, so a line validation
                    # refused gets that 400
                    check_images(request.images, store=work.store, policy=self.image_policy)
                    check_model_takes_images(request.images, False, request.model)
                parsed.append((line, request))
            except LineError as err:  # a body error (validation counted the line and indexed it), a line
                # validated under looser rules, or an image refused before reading it
                self._refuse(work, line, work.remaining.setdefault(line, custom_id_of(raw)), err)
        return parsed

    def _prepare_lines(
        self, batch: QueuedBatch, work: HeldRange, parsed: list[tuple[int, ParsedRequest]], counted: list[int]
    ) -> None:
        """Prepare the parsed lines in order. Images are read and opened from their headers a few lines ahead
        (`_read_ahead`), and a line's images are decoded only once it holds their cost of the worker's image
        budget (`_next_group`): never a whole range's images at once. Prepared lines are queued for the engine
        together (a range of text lines at once, as it is read), and before a line waits for image memory, so
        the engine runs, and frees, what is prepared while later lines wait."""
        pending, reads, prepared = deque(parsed), deque(), []
        stop = lambda: batch.batch_id in self._stopped  # noqa: E731

        def flush() -> bool:  # before a line waits for image memory: what is prepared goes to the engine
            queued = self._queue_prepared(work, prepared, counted)
            prepared.clear()
            return queued

        while pending or reads:
            self._read_ahead(pending, reads, work.store)
            group = self._next_group(work, reads, stop, counted, flush)
            if group is None:  # the batch stopped (or the range was aborted) while a line waited
                return
            try:
                while group:
                    if stop():  # a cancel lands between lines, not after a group's 2,048 inputs each
                        return
                    line, request, hold, decoding = group[0]
                    ready = self._prepare_line(batch, work, line, request, decoding, counted)
                    group.pop(0)
                    del decoding  # the decoded images go with their futures
                    if hold.cost >= TRIM_AFTER_BYTES:  # their pages back to the system before the bytes
                        trim_heap()  # go back to the budget
                    hold.release()
                    if ready is not None:
                        self._count_tensors(ready)
                        prepared.append(ready)
                    ready = None  # no local of this frame keeps a line's tensors (and budget) while it waits
            finally:
                for _, _, hold, decoding in group:  # a line raised: let its fellows' decodes end, free theirs
                    for image in decoding:
                        image.exception()
                    hold.release()
        if prepared:
            self._queue_prepared(work, prepared, counted)

    def _read_ahead(self, pending: deque, reads: deque, store) -> None:
        """Start reading (and opening from their headers) the images of the next lines: at least one line, and
        more while fewer than the decoding threads' count of images are read ahead."""
        images = sum(len(futures) for _, _, futures in reads)
        while pending and (not reads or images < self.image_policy.image_decode_threads):
            line, request = pending.popleft()
            futures = (
                start_reading(request.images, store=store, policy=self.image_policy) if request.images else []
            )
            reads.append((line, request, futures))
            images += len(futures)

    def _next_group(self, work: HeldRange, reads: deque, stop, counted: list[int], flush) -> list | None:
        """The lines read ahead whose images may decode now, each with its hold on the image budget and its
        decoding futures: the first waits for its share, after `flush()` queued what is prepared (None if the
        batch stops, or the range was aborted, meanwhile), the others join while their images are read and fit
        beside it. A line whose images cannot be read, or cost more than the whole budget, is refused here."""
        group: list = []
        while reads:
            line, request, futures = reads[0]
            if group and not all(f.done() for f in futures):
                break
            try:
                probed: list[Probed] = [f.result() for f in futures]
                cost = check_line_cost(probed, self.image_budget.total)
            except LineError as err:
                reads.popleft()
                self._refuse_prepared(work, line, request.custom_id, err, counted)
                continue
            hold = self.image_budget.try_acquire(cost)
            if hold is None and not group:
                if not flush():
                    return None
                hold = self.image_budget.acquire(cost, stop)
                if hold is None:
                    return None
            if hold is None:
                break
            reads.popleft()
            group.append((line, request, hold, start_decoding(probed, self.image_policy) if probed else []))
        return group

    def _prepare_line(
        self,
        batch: QueuedBatch,
        work: HeldRange,
        line: int,
        request: ParsedRequest,
        decoding: list[Future],
        counted: list[int],
    ) -> list[Prepared] | None:
        """One line's engine requests (its images decoded and processed); None if it was refused (its 400
        settled)."""
        subs = split_prompts(request)
        try:
            images = [image.result() for image in decoding]
            ready = [
                self._prepared(f"{batch.batch_id}|{line}", work.key, sub, k, len(subs), images)
                for k, sub in enumerate(subs)
            ]
        except LineError as err:
            self._refuse_prepared(work, line, request.custom_id, err, counted)
            return None
        return ready

    def _count_tensors(self, ready: list[Prepared]) -> None:
        """What stays of a line's image memory, its pixel tensors, counted in the budget until the engine drops
        them (the request ended). A method of its own: no local of a waiting frame may keep them alive."""
        for p in ready:
            if p.images is not None:
                self.image_budget.add(p.images.nbytes).until_freed(p.images)

    def _queue_prepared(self, work: HeldRange, lines: list[list[Prepared]], counted: list[int]) -> bool:
        """Prepared lines' requests to the engine; False if their range was aborted meanwhile."""
        with self._cond:
            if work.key not in self._ranges:
                return False
            for ready in lines:
                self._inbox.extend(ready)
            self._preparing -= len(lines)
            counted[0] -= len(lines)
            self._cond.notify_all()
        return True

    def _refuse_prepared(
        self, work: HeldRange, line: int, custom_id: str, err: LineError, counted: list[int]
    ) -> None:
        """_refuse for a line of a range the engine may already be settling (registered): under the lock."""
        with self._cond:
            if work.key in self._ranges:
                self._refuse(work, line, custom_id, err)
            self._preparing -= 1
            counted[0] -= 1

    def _refuse(self, work: HeldRange, line: int, custom_id: str, err: LineError) -> None:
        refused = refused_line(custom_id, err.message, err.code, err.param)
        self._settle(work, line, PartEntry.of(line, False, refused))

    def _prepared(
        self, request_id: str, key: tuple, request: ParsedRequest, part: int, count: int, images: list
    ) -> Prepared:
        if images:
            ids, inputs = tokenize_with_images(request, self.engine.processor, images)
        else:
            ids, inputs = tokenize(request, self.engine.tokenizer), None
        params = fit_context(request, len(ids), self.engine.max_model_len)
        return Prepared(
            request_id if count == 1 else f"{request_id}|{part}",
            key,
            request,
            ids,
            params,
            part,
            count,
            inputs,
        )

    def _parse(self, raw: bytes, line: int, batch: QueuedBatch) -> ParsedRequest:
        """The line as the engine runs it: parsed, its adapter picked (the same rule validation applied)
        and loaded; LineError refuses the line alone."""
        request = parse_line(raw, line, batch.endpoint)
        if request.messages is not None:  # chat and responses lines: their output is read for reasoning
            request.reasoning_parser = batch.reasoning_parser  # None: render_chat reads the template's
            request.template_kwargs = {**batch.template_options, **request.template_kwargs}  # the line's win
            if request.tools:
                request.tool_format = batch.tool_parser  # None: render_chat reads the template's
            if request.thinking_budget is None:
                request.thinking_budget = batch.thinking_budget
        request.lora = pick_adapter(request.model, batch.model, batch.loras)
        if request.lora is not None:
            self._load_lora(request.lora, batch.loras[request.lora], batch.endpoint_url)
        return request

    def _load_lora(self, name: str, path: str, endpoint_url: str | None) -> None:
        """Have the adapter in the engine before the first line that names it is queued (its host copy stays
        there, the engine moves it into a device slot when a step needs it); LineError, that line's 400,
        if it cannot be loaded. An adapter renamed to another path is loaded anew. A refusal is
        remembered for the adapter's name, path and files (a folder rewritten in place is tried again),
        so its later lines and batches fail at once; whatever its load raised (a corrupt file the checks
        refused, a feature the engine refuses, or anything else) refuses its lines, never their range."""
        if self._loras.get(name) == path:
            return
        if path not in self._versions:
            self._versions[path] = folder_version(path)
        key = (name, path, self._versions[path])
        if key not in self._lora_failed:
            local = None
            try:
                local = fetch_folder(path, ADAPTER_CONFIG, "adapter", endpoint_url=endpoint_url)
                self._on_engine_thread(lambda: self._swap_lora(name, local))
                self._loras[name] = path
                return
            except Exception as exc:  # the engine's LoraError / CheckpointError are ValueErrors
                if not isinstance(exc, (OSError, ValueError)):
                    log.exception("worker %d: adapter %s at %s could not be loaded", self.index, name, path)
                else:
                    log.error(
                        "worker %d: LoRA adapter %r (%s) cannot be loaded: %s", self.index, name, path, exc
                    )
                self._lora_failed[key] = _client_reason(exc, name, path, local)
        raise LineError(
            "model_not_loaded",
            f"body.model {name!r}: the LoRA adapter cannot be loaded: {self._lora_failed[key]}",
            "body.model",
        )

    def _swap_lora(self, name: str, local: str) -> None:
        if name in self._loras:
            self.engine.remove_lora(name)
        self.engine.add_lora(name, local)

    def _store(self, open_args: dict[str, Any]):
        key = json.dumps(open_args, sort_keys=True)
        if key not in self._stores:
            self._stores[key] = open_store(**open_args)
        return self._stores[key]

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


def _client_reason(exc: Exception, name: str, path: str, local: str | None) -> str:
    """Why an adapter cannot be loaded, as its line's 400 says it: the engine's refusal (DoRA, a rank
    over the limit...) with the adapter's folder written as its name; never a path of the server (its
    folder, the node's cache), which the service's log has. A folder that cannot be read is said so."""
    if isinstance(exc, OSError):
        return "its files could not be read (the service's log says why)"
    message = str(exc)
    paths = {path, path.removeprefix("file://")}
    if local:
        paths |= {str(local), os.path.realpath(local)}
    for server_path in sorted((p.rstrip("/") for p in paths if p), key=len, reverse=True):
        message = message.replace(server_path, name)
    return f"{type(exc).__name__}: {message}"


def folder_version(path: str) -> str:
    """The version of a local model or adapter folder a refusal is remembered for: its files' names, sizes
    and modification times (a folder rewritten in place is a new version); an object-store URL is copied to
    the node once and kept, so its path is its version ("")."""
    if "://" in path and not path.startswith("file://"):
        return ""
    try:
        with os.scandir(path.removeprefix("file://")) as entries:
            files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in entries if e.is_file())
    except OSError:
        return ""
    return repr(files)
