"""The deadline on tensor-parallel steps that replay CUDA graphs (their captured collectives are outside
NCCL's watchdog). On CPU a step's completion is a flag the test sets where a CUDA event would finish."""

from __future__ import annotations

import threading
import time

from bulkgen.engine.parallel.replay_watchdog import ReplayWatchdog


class Step:
    """A step's completion as the watchdog queries it (torch.cuda.Event.query on CUDA)."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def _watchdog(timeout_s: float) -> tuple[ReplayWatchdog, threading.Event, list[float]]:
    fired, waited = threading.Event(), []

    def on_timeout(seconds: float) -> None:
        waited.append(seconds)
        fired.set()

    return ReplayWatchdog(timeout_s, on_timeout=on_timeout, poll_s=0.05), fired, waited


def test_a_step_unfinished_past_the_timeout_ends_the_group():
    watchdog, fired, waited = _watchdog(timeout_s=0.3)
    watchdog.watch(Step(done=True))
    watchdog.watch(Step())  # a rank lost inside the replay: the device never finishes it
    assert fired.wait(10)
    assert waited[0] > 0.3


def test_steps_that_finish_are_dropped_and_never_fire():
    watchdog, fired, _ = _watchdog(timeout_s=2.0)
    steps = [Step() for _ in range(5)]
    for step in steps:
        watchdog.watch(step)
    time.sleep(0.2)  # steps still running when the watchdog looks
    for step in steps:
        step.done = True
    assert not fired.wait(2.2)
    assert not watchdog._pending
    watchdog.close()
