"""The dispatcher's liveness rule, on the real work queue (no Ray, no engine; tests/runtime/test_slow_load.py
runs it whole): before a worker's first load has finished, a poll it leaves unanswered is not a loss and
its load's progress is read as alive; after, --worker-poll-deadline applies; a load past its own deadline
(--model-load-deadline + --model-load-seconds-per-gb x the checkpoint's GB) is LoadHung, which names both,
fails the next batch of that model and replaces the worker without loading the model again."""

from __future__ import annotations

import pytest
from ray.exceptions import GetTimeoutError

from bulkgen.runtime import dispatch
from bulkgen.runtime.dispatch import LoadHung
from bulkgen.settings import WorkerSettings
from tests.runtime.test_worker_loss import _dispatcher, _Pool, _ranges, _Runner

GB = 10**9


class _FatalRunner(_Runner):
    def __init__(self, batch_id: str) -> None:
        super().__init__(batch_id)
        self.fatal_reason: str | None = None

    def fatal(self, message: str) -> None:
        self.fatal_reason = message


def _answers(monkeypatch, *answers):
    """ray.get answers these in turn: a dict is the worker's answer, None a wait that timed out."""
    left = list(answers)

    def get(ref, timeout=None):
        answer = left.pop(0)
        if answer is None:
            raise GetTimeoutError("timed out")
        return answer

    monkeypatch.setattr(dispatch.ray, "get", get)
    return left


def _poll(loads: int, loading: dict | None = None) -> dict:
    return {"model": None, "loads": loads, "loading": loading}


def _loading(elapsed: float, size: int = 7 * GB, done: int = 3 * GB) -> dict:
    return {
        "model": "big",
        "phase": "reading",
        "elapsed_s": elapsed,
        "checkpoint_bytes": size,
        "bytes_done": done,
    }


def _fresh(settings: WorkerSettings | None = None):
    pool, runner = _Pool(failures=0), _FatalRunner("b1")
    pool.settings = settings or WorkerSettings(poll_deadline_s=5.0)
    d, queue = _dispatcher(pool, runner)
    d._ready, d._loading = [False, False], [None, None]
    d._alive_at = [dispatch.time.monotonic()] * 2
    return d, queue, pool, runner


def test_before_the_first_load_unanswered_polls_are_waited_for_while_the_load_is_within_its_deadline(
    monkeypatch,
):
    d, _, _, _ = _fresh()
    left = _answers(monkeypatch, None, None, _poll(0, _loading(40.0)), None, _poll(1))
    assert d._answer(0, object())["loading"]["elapsed_s"] == 40.0  # two unanswered polls: not lost
    assert not d._ready[0] and d._loading[0]["bytes_done"] == 3 * GB  # loading, seen alive
    assert d._answer(0, object())["loads"] == 1 and d._ready[0] and left == []
    assert d._loading[0] is None


def test_after_the_first_load_the_poll_deadline_applies(monkeypatch):
    d, _, _, _ = _fresh()
    d._ready[0] = True
    _answers(monkeypatch, None)
    with pytest.raises(GetTimeoutError):
        d._answer(0, object())


def test_a_load_past_its_deadline_is_hung_and_the_error_names_the_deadline_and_the_size(monkeypatch):
    d, _, _, _ = _fresh()  # defaults: 600 s + 60 s/GB: 7 GB may take 1020 s
    _answers(monkeypatch, _poll(0, _loading(1000.0)))
    d._answer(0, object())  # within: alive
    _answers(monkeypatch, _poll(0, _loading(1021.0)))
    with pytest.raises(LoadHung) as hung:
        d._answer(0, object())
    assert str(hung.value) == (
        "model 'big' did not load within its deadline of 1020.0 s (--model-load-deadline 600 s + "
        "--model-load-seconds-per-gb 60 s x 7.00 GB checkpoint); it was reading, 3.00 GB read"
    )


def test_a_worker_that_never_answers_is_hung_after_the_load_deadline_from_its_last_answer(monkeypatch):
    d, _, _, _ = _fresh(WorkerSettings(poll_deadline_s=5.0, load_deadline_s=30.0, load_s_per_gb=0.0))
    d._alive_at[0] -= 31.0  # its last answer: 31 s ago, at the start of its load
    d._loading[0] = _loading(0.0)
    left = _answers(monkeypatch, None, None)
    with pytest.raises(LoadHung, match=r"deadline of 30.0 s"):
        d._answer(0, object())
    assert len(left) == 1  # the first unanswered poll past the deadline


def test_a_hung_load_fails_the_next_batch_of_its_model_and_the_worker_is_replaced_without_it(monkeypatch):
    d, queue, pool, runner = _fresh()
    d._model_of[0] = ("big", "/models/big")
    monkeypatch.setattr(dispatch, "REPLACE_BACKOFF_S", (0.001, 0.002))
    d._load_hung(0, LoadHung("big", "model 'big' did not load within its deadline of 1.0 s"))
    assert pool.attempts == 1 and pool.workers[0].calls == []  # replaced, and not told to load it again
    assert d._model_of[0] is None and not d._ready[0]
    ranges = _ranges(queue, "b1")
    for r in ranges:
        r.batch.model = "big"
    assert d._load(0, pool.workers[0], ranges) is False
    assert runner.fatal_reason == "model 'big' did not load within its deadline of 1.0 s"
    assert d._hung == {}  # the batch after it loads afresh


def test_a_worker_that_never_started_is_lost_after_the_deadlines_base_not_hung(monkeypatch):
    d, _, _, _ = _fresh(WorkerSettings(poll_deadline_s=5.0, load_deadline_s=30.0))
    d._answered[0] = False  # its process has not answered once: it is still starting
    d._alive_at[0] -= 29.0
    left = _answers(monkeypatch, None, _poll(0))
    d._answer(0, object())  # 29 s: still starting, waited for
    assert d._answered[0] and left == []
    d._answered[0], d._alive_at[0] = False, d._alive_at[0] - 31.0
    _answers(monkeypatch, None)
    with pytest.raises(GetTimeoutError, match="worker 0 did not start within --model-load-deadline 30 s"):
        d._answer(0, object())


def test_a_started_worker_told_to_load_nothing_is_judged_by_the_poll_deadline(monkeypatch):
    d, _, _, _ = _fresh()
    d._model_of[0] = None  # a service's idle worker: no model asked of it yet
    _answers(monkeypatch, _poll(0), None)
    d._answer(0, object())  # it started, and loads nothing
    with pytest.raises(GetTimeoutError):
        d._answer(0, object())
