"""The dispatcher: one driver thread per worker actor, feeding it from the work queue as it has room.

Each thread long-polls its worker; the answer says how many requests the engine wants (and how many
more of a batch new to it: `take_for`), which ranges finished (parts already stored) and the worker's
steps per batch, which go to the batch runners. A worker that dies (killed, out of memory, node lost)
shows up as a failed poll: its ranges in flight go back to the queue and a new actor takes its place
under the same name.

A worker is judged by `--worker-poll-deadline` only once its first load has finished (Kubernetes'
startup probes): until then, starting or loading, it answers its polls with its load's progress
(runtime/worker.py), and it is failed only when the load outlasts its own deadline, `--model-load-deadline`
plus `--model-load-seconds-per-gb` per GB of the checkpoint (LoadHung, naming both). Loading 7 GB on a
busy host is not a lost worker; killing it would only start the same load from zero.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future

import ray
from ray.exceptions import GetTimeoutError, RayError

from bulkgen.engine.model.checkpoint_checks import CheckpointError
from bulkgen.runtime.workqueue import MAX_ATTEMPTS, QueuedRange, WorkQueue

log = logging.getLogger(__name__)

POLL_WAIT_S = 0.5
BUSY_WINDOW_S = 30.0  # a worker's busy share is measured over this recent window
POLL_DEADLINE_S = 120.0  # calls other than polls (abort) may take this long before the worker counts as lost
REPLACE_BACKOFF_S = (1.0, 60.0)  # first and longest wait between attempts to replace a lost worker


class LoadHung(Exception):
    """A model load outlasted its deadline (its message names it, and the checkpoint's size)."""

    def __init__(self, model: str, message: str) -> None:
        super().__init__(message)
        self.model = model
        self.reported = False  # a batch that asked for the model failed with it already


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def take_for(
    queue: WorkQueue, index: int, poll: dict, holding: set[str], ranks: int = 1
) -> list[QueuedRange]:
    """What worker `index` (of `ranks` ranks) gets after `poll`: what it wants, or, when full, work of a
    batch it holds none of (`holding`: the batches of its ranges in flight) up to its spare room, so a
    newcomer starts at once."""
    idle = not holding and poll["held"] == 0
    if poll["want"] >= 1:
        return queue.take(index, poll["want"], poll["model"], idle, ranks=ranks)
    if poll.get("spare", 0) >= 1:
        return queue.take(index, poll["spare"], poll["model"], idle, exclude=holding, ranks=ranks)
    return []


class Dispatcher:
    def __init__(self, pool, queue: WorkQueue, endpoint_url: str | None, runner_of, owner: str) -> None:
        self.pool, self.queue, self.endpoint_url = pool, queue, endpoint_url
        self.owner = owner  # this driver's name on workers that several drivers share
        self.runner_of = runner_of  # batch id -> its BatchRunner here, or None
        self.inflight: list[dict[tuple, QueuedRange]] = []
        self.models_loaded: list[str | None] = []
        self._model_of: list[tuple[str, str] | None] = []
        self.nodes: list[str | None] = []
        self.threads: list[int | None] = []
        self.step_times: list[dict | None] = []
        self.ranks: list[list[dict] | None] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._had_work: list[bool] = []
        self._last_poll: dict[int, dict] = {}  # per worker: its last answer that found nothing queued
        self._news: list[threading.Event] = []  # per worker: ranges were queued, or its poll answered
        self._busy: list[deque] = []  # per worker: (arrival time, step seconds) of recent polls
        self._busy_total: list[float] = []  # per worker: its `busy_s` at its last poll
        self._started = time.monotonic()
        self._ready: list[bool] = []  # per worker: its actor finished a load (the poll deadline applies)
        self._alive_at: list[float] = []  # per worker: when it last answered (or its actor was started)
        self._answered: list[bool] = []  # per worker: its actor answered once (it started)
        self._loading: list[dict | None] = []  # per worker: its load under way, as it last reported it
        self._hung: dict[str, str] = {}  # model -> why its load was given up, for the next batch asking

    def start(self) -> None:
        self.inflight = [{} for _ in self.pool.workers]
        self.models_loaded = [None for _ in self.pool.workers]
        self._model_of = [None for _ in self.pool.workers]  # (name, path) each worker was told to load
        self.nodes = [None for _ in self.pool.workers]  # each worker's node IP, from its polls
        self.threads = [None for _ in self.pool.workers]  # torch threads of each worker's forward
        self.step_times = [None for _ in self.pool.workers]  # each engine's step wall times, from its polls
        self.ranks = [None for _ in self.pool.workers]  # a tensor-parallel group's ranks, from its polls
        self._had_work = [True for _ in self.pool.workers]
        self._news = [threading.Event() for _ in self.pool.workers]
        self.queue.on_work(self._work_queued)
        self._busy = [deque(maxlen=4096) for _ in self.pool.workers]
        self._busy_total = [0.0 for _ in self.pool.workers]
        self._started = time.monotonic()
        self._ready = [False for _ in self.pool.workers]
        self._alive_at = [self._started for _ in self.pool.workers]
        self._answered = [False for _ in self.pool.workers]
        self._loading = [None for _ in self.pool.workers]
        for index in range(len(self.pool.workers)):
            threading.Thread(
                target=self._loop, args=(index,), name=f"bulkgen-dispatch-{index}", daemon=True
            ).start()

    def stop(self) -> None:
        self._stopped.set()

    def preload(self, model: str, path: str, ranks: int = 1) -> None:
        """Have every worker of `model`'s rank count load it now, before any range of it is handed out
        (`bulkgen run` starts the workers while its file is validated). A later `_load` of the same model
        waits for this one."""
        for index, handle in enumerate(self.pool.workers):
            if self.pool.ranks[index] == ranks:
                self._model_of[index] = (model, path)
                handle.load.remote(model, path, self.endpoint_url)

    def abort_batch(self, batch_id: str, code: str | None) -> None:
        """Stop the batch on every worker; with `code`, each writes the parts of its ranges first."""
        calls = [w.abort_batch.remote(batch_id, code) for w in self.pool.workers]
        for call in calls:
            try:
                ray.get(call, timeout=POLL_DEADLINE_S)
            except RayError as exc:  # a dead worker's ranges are simply not covered: the runner fills in
                log.warning("abort of %s on a worker failed: %s", batch_id, exc)
        with self._lock:
            for inflight in self.inflight:
                for key in [k for k in inflight if k[0] == batch_id]:
                    del inflight[key]

    def forget_batch(self, batch_id: str) -> None:
        for w in self.pool.workers:
            w.forget.remote(batch_id)

    # -- one thread per worker -------------------------------------------------------------------------
    def _loop(self, index: int) -> None:
        while not self._stopped.is_set():
            try:
                self._serve(index)
            except LoadHung as exc:
                self._load_hung(index, exc)
            except (RayError, GetTimeoutError) as exc:
                self._lost(index, exc)
            except Exception:
                log.exception("dispatcher %d: unexpected error", index)
                self._stopped.wait(1.0)

    def _serve(self, index: int) -> None:
        handle = self.pool.workers[index]
        ref = handle.poll.remote(self.owner, POLL_WAIT_S, self._had_work[index])
        handed = not self._had_work[index] and self._hand_while_polling(index, handle, ref.future())
        poll = self._answer(index, ref)
        self.models_loaded[index] = poll["model"]
        self.nodes[index] = poll.get("node_ip")
        self.threads[index] = poll.get("threads")
        self.step_times[index] = poll.get("step_time")
        self.ranks[index] = poll.get("ranks")
        self._route(index, poll)
        self._news[index].clear()  # before the take: ranges queued after it wake the next poll's wait
        if handed:  # the worker got ranges while this poll waited: its room is read afresh by the next
            self._had_work[index] = True
            return
        with self._lock:
            holding = {key[0] for key in self.inflight[index]}
        ranges = take_for(self.queue, index, poll, holding, self.pool.ranks[index])
        if poll["want"] >= 1:
            self._had_work[index] = bool(ranges)  # nothing queued: next poll waits for results, not for room
            self._last_poll[index] = poll
        if ranges:
            self._hand(index, handle, ranges, poll["model"])

    def _answer(self, index: int, ref) -> dict:
        """The worker's answer to a poll. Once its first load has finished, GetTimeoutError (lost) after
        --worker-poll-deadline; before, it is starting or loading, and the wait goes on while its load is
        within its own deadline (LoadHung after). A worker that started, loads nothing and was told to load
        nothing (a service's idle worker) is judged by the poll deadline too."""
        deadline = self.pool.settings.poll_deadline_s
        while True:
            try:
                poll = ray.get(ref, timeout=deadline)
                break
            except GetTimeoutError:
                idle = (
                    self._answered[index] and self._loading[index] is None and self._model_of[index] is None
                )
                if self._ready[index] or idle:
                    raise
                self._check_load(index, None)
        self._alive(index, poll)
        return poll

    def _alive(self, index: int, answer: dict) -> None:
        """The worker answered (a poll, or liveness while it loads): note its load's progress, and whether
        its first load has finished; a load past its deadline raises LoadHung."""
        self._alive_at[index], self._answered[index] = time.monotonic(), True
        if answer.get("loads", 1) >= 1:  # an answer without `loads`: a worker that predates them
            self._ready[index] = True
        self._loading[index] = answer.get("loading")
        if answer.get("loading") is not None:
            self._check_load(index, answer["loading"])

    def _check_load(self, index: int, loading: dict | None) -> None:
        """LoadHung if worker `index`'s load has run past its deadline: by the worker's own count when it
        reported one (`loading`), else since it last answered. A worker that never answered is still
        starting (a process that imports torch): GetTimeoutError (lost) once that outlasts the deadline's
        base, --model-load-deadline."""
        if loading is None and not self._answered[index]:
            silent = time.monotonic() - self._alive_at[index]
            if silent > self.pool.settings.load_deadline_s:
                raise GetTimeoutError(
                    f"worker {index} did not start within --model-load-deadline "
                    f"{self.pool.settings.load_deadline_s:g} s"
                )
            return
        took = (loading.get("elapsed_s") or 0.0) if loading is not None else None
        loading = loading or self._loading[index] or {}
        if took is None:  # no answer: its last report's time, and the silence since
            took = (loading.get("elapsed_s") or 0.0) + time.monotonic() - self._alive_at[index]
        size = loading.get("checkpoint_bytes")
        size = max(size or 0, loading.get("bytes_done") or 0) or None  # an s3:// copy: what has landed
        limit = self.pool.settings.load_deadline_for(size)
        if took <= limit:
            return
        model = loading.get("model") or (self._model_of[index] or ("a model", ""))[0]
        raise LoadHung(model, self._hung_message(model, limit, size, loading))

    def _hung_message(self, model: str, limit: float, size: int | None, loading: dict) -> str:
        s = self.pool.settings
        what = f"{_size(size)} checkpoint" if size is not None else "checkpoint of unknown size"
        where = ""
        if loading.get("phase"):
            where = f"; it was {loading['phase']}, {_size(loading.get('bytes_done') or 0)} read"
        return (
            f"model {model!r} did not load within its deadline of {limit:.1f} s "
            f"(--model-load-deadline {s.load_deadline_s:g} s + --model-load-seconds-per-gb "
            f"{s.load_s_per_gb:g} s x {what}){where}"
        )

    def _hand_while_polling(self, index: int, handle, answered: Future) -> bool:
        """The worker had room and the queue nothing, so its poll waits for results alone: ranges queued
        meanwhile go to it at once (they waited up to POLL_WAIT_S for the poll's answer before, an idle
        worker's every time a batch arrived), sized by the room its last answer reported, which has only
        grown since (nothing was assigned to it after that answer). True if it got any."""
        last, news = self._last_poll.get(index), self._news[index]
        if last is None:
            return False
        answered.add_done_callback(lambda _: news.set())
        deadline = time.monotonic() + self.pool.settings.poll_deadline_s
        while not answered.done() and news.wait(max(0.0, deadline - time.monotonic())):
            news.clear()
            if answered.done():
                break
            with self._lock:
                holding = {key[0] for key in self.inflight[index]}
            ranges = take_for(self.queue, index, last, holding, self.pool.ranks[index])
            if ranges:
                self._hand(index, handle, ranges, last["model"])
                return True
        return False

    def _work_queued(self) -> None:
        for news in self._news:
            news.set()

    def _hand(self, index: int, handle, ranges: list[QueuedRange], loaded: str | None) -> None:
        batch = ranges[0].batch
        if loaded != batch.model_key and not self._load(index, handle, ranges):
            return
        with self._lock:
            self.inflight[index].update((r.key, r) for r in ranges)
        handle.assign.remote(batch, [r.bounds for r in ranges], self.owner)

    def _load(self, index: int, handle, ranges: list[QueuedRange]) -> bool:
        """Have the worker load the ranges' model, however long that takes within the load's deadline:
        while it loads, its progress is asked every --worker-poll-deadline. A load past its deadline (or
        one that hung on another worker just before) fails the batch with that reason."""
        batch = ranges[0].batch
        model = batch.model
        runner = self.runner_of(batch.batch_id)
        if model in self._hung:
            reason = self._hung.pop(model)
            if runner is not None:
                runner.fatal(reason)
            return False
        try:
            self._until_loaded(index, handle, handle.load.remote(model, batch.model_path, self.endpoint_url))
            return True
        except LoadHung as exc:
            if runner is not None:
                runner.fatal(str(exc))
                exc.reported = True
            raise
        except (RayError, GetTimeoutError) as exc:
            if isinstance(exc, ray.exceptions.RayTaskError):  # the model itself cannot load: the batch fails
                cause = getattr(exc, "cause", exc)
                if isinstance(cause, CheckpointError):
                    # refused at load (a broken checkpoint; the worker remembers it and refuses again at
                    # once): these lines are 400s, never re-queued or halved, and the batch goes on
                    for r in ranges if runner is not None else ():
                        message = f"body.model {model!r}: the model cannot be loaded: {cause}"
                        runner.refuse_range(r, "model_not_loaded", message, "body.model")
                    return False
                if runner is not None:
                    runner.fatal(
                        f"model {model!r} could not be loaded: {exc.cause if hasattr(exc, 'cause') else exc}"
                    )
                return False
            reason = f"the worker loading this request's model died {MAX_ATTEMPTS} times"
            self._give_up(self.queue.put_back(ranges), reason)  # never dropped: each line ends once
            raise

    def _until_loaded(self, index: int, handle, load) -> None:
        """Wait for the `load` call to finish; between waits of --worker-poll-deadline, the worker's
        liveness (`progress`) says how its load goes: LoadHung once it is past its deadline."""
        deadline = self.pool.settings.poll_deadline_s
        while True:
            try:
                ray.get(load, timeout=deadline)
                return
            except GetTimeoutError:
                pass
            try:
                self._alive(index, ray.get(handle.progress.remote(), timeout=deadline))
            except GetTimeoutError:
                self._check_load(index, None)

    def _route(self, index: int, poll: dict) -> None:
        holding = {r.batch_id: r for r in self._runners_in_flight(index)}  # before done ranges leave
        for outcome in poll["done"]:
            with self._lock:
                r = self.inflight[index].pop(outcome.bounds.key, None)
            if outcome.error is not None:
                if r is not None and outcome.storage_down:  # no attempt used, no request failed
                    self.queue.put_back([r], count=False)
                elif r is not None:
                    self._give_up(self.queue.put_back([r]), outcome.error)
                continue
            if r is not None:  # its tenant's share counts the tokens the range really used
                self.queue.settle(r, outcome.tally.input_tokens + outcome.tally.output_tokens)
            runner = self.runner_of(outcome.bounds.batch_id)
            if runner is not None:
                runner.range_done(outcome)
        # the worker's own count of its step time, not its steps of this driver's batches: a worker busy with
        # another driver's work, or with a batch no driver runs any more, is busy all the same
        total = float(poll.get("busy_s", 0.0))
        busy = total - self._busy_total[index] if total >= self._busy_total[index] else total  # replaced
        self._busy_total[index] = total
        if busy > 0:
            self._busy[index].append((time.monotonic(), busy))
        for batch_id, records in poll["steps"].items():
            runner = self.runner_of(batch_id)
            if runner is not None:
                runner.add_steps(f"bulkgen-worker-{index}", records)
        for runner in holding.values():
            runner.live_progress(f"bulkgen-worker-{index}", poll["progress"].get(runner.batch_id))

    def worker_states(self) -> list[dict]:
        """What each worker does now, for the dashboard: cheap (no call to the workers)."""
        now = time.monotonic()
        window = max(1e-3, min(BUSY_WINDOW_S, now - self._started))
        states = []
        with self._lock:
            for index, inflight in enumerate(self.inflight):
                batches: dict[str, int] = {}
                for batch_id, lo, hi in inflight:
                    batches[batch_id] = batches.get(batch_id, 0) + hi - lo
                busy = sum(d for t, d in list(self._busy[index]) if t >= now - window)
                model = self.models_loaded[index] if index < len(self.models_loaded) else None
                states.append(
                    {
                        "id": f"bulkgen-worker-{index}",
                        "index": index,
                        "device": "gpu" if self.pool.use_gpu else "cpu",
                        "tensor_parallel": self.pool.ranks[index],  # its class: models of this count only
                        "node_ip": self.nodes[index],
                        "cpu_threads": self.threads[index],
                        "step_time": self.step_times[index],
                        "ranks": self.ranks[index],  # None: one process; else each rank's pid, device, memory
                        "model": model.split("@", 1)[0] if model else None,
                        "loading": self._loading[index] if index < len(self._loading) else None,
                        "busy_share": round(min(1.0, busy / window), 4),
                        "batches": [{"id": b, "requests_in_flight": n} for b, n in sorted(batches.items())],
                    }
                )
        return states

    def _runners_in_flight(self, index: int) -> list:
        with self._lock:
            batches = {key[0] for key in self.inflight[index]}
        return [r for r in map(self.runner_of, batches) if r is not None]

    def _lost(self, index: int, exc: Exception) -> None:
        log.warning(
            "worker %d on %s lost (%s); its ranges go back to the queue",
            index,
            self.nodes[index] or "an unknown node",
            type(exc).__name__,
        )
        holding = self._runners_in_flight(index)
        with self._lock:
            lost, self.inflight[index] = list(self.inflight[index].values()), {}
        for runner in holding:  # its unwritten results are redone elsewhere: never count them twice
            runner.live_progress(f"bulkgen-worker-{index}", None)
        self.models_loaded[index] = None
        self._had_work[index] = True  # its replacement's room is learnt afresh
        self._last_poll.pop(index, None)
        self._give_up(self.queue.put_back(lost), f"the worker running this request died {MAX_ATTEMPTS} times")
        self._replace(index)

    def _load_hung(self, index: int, exc: LoadHung) -> None:
        """Worker `index`'s load outlasted its deadline: the next batch of that model fails with the reason
        (unless a batch asking for it failed already), and the worker, stuck in its load, is replaced
        without being told to load the model again."""
        log.error("worker %d: %s; it is replaced", index, exc)
        if self._model_of[index] is not None and self._model_of[index][0] == exc.model:
            self._model_of[index] = None
        if not exc.reported:
            self._hung[exc.model] = str(exc)
        self._lost(index, exc)

    def _replace(self, index: int) -> None:
        """A new actor in the lost one's place, however long that takes (no GPU may free for hours):
        retried with backoff while the dispatcher runs; then it loads the lost worker's model at once."""
        delay, longest = REPLACE_BACKOFF_S
        while not self._stopped.is_set():
            try:
                handle = self.pool.replace(index)
                break
            except Exception as exc:
                log.warning("worker %d not replaced yet (%s); trying again in %.0f s", index, exc, delay)
                self._stopped.wait(delay)
                delay = min(delay * 2, longest)
        else:
            return
        self.nodes[index] = None
        self._ready[index], self._alive_at[index], self._loading[index] = False, time.monotonic(), None
        self._answered[index] = False
        if self._model_of[index] is not None:
            name, path = self._model_of[index]
            handle.load.remote(name, path, self.endpoint_url)  # the worker serializes loads: no double load

    def _give_up(self, ranges: list[QueuedRange], reason: str) -> None:
        for r in ranges:
            runner = self.runner_of(r.batch.batch_id)
            if runner is not None:
                runner.give_up(r, reason)
