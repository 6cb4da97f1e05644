"""Rank 0's watch on its followers (runtime/groups.FollowerWatch), on the suite's real local Ray with stand-in
follower actors: a follower actor that dies while its model is live is reported at once, naming its rank and
the cause (in a worker this ends rank 0, so the group is lost as one worker); one whose own code raised is
remembered as the model's failure, not as a lost group; a model rank 0 closed or gave up is no longer
watched."""

from __future__ import annotations

import time

import ray

from bulkgen.runtime.groups import FollowerWatch, _Serving
from bulkgen.runtime.pool import init_ray
from tests.support.wait import wait_until


@ray.remote(max_concurrency=2)
class _Follower:
    def serve(self, how: str) -> None:
        if how == "raise":
            raise ValueError("rank 1 cannot read its shard")
        time.sleep(300)  # a follower loading or following steps

    def ping(self) -> bool:
        return True


def _watch() -> tuple[FollowerWatch, list[str]]:
    lost: list[str] = []

    def on_lost(message: str) -> None:
        lost.append(message)

    return FollowerWatch(on_lost), lost


def _calls(watch: FollowerWatch, how: list[str]) -> tuple[list, list[_Serving]]:
    actors = [_Follower.remote() for _ in how]
    ray.get([a.ping.remote() for a in actors], timeout=120)
    calls = [
        _Serving(a.serve.remote(h), r, f"g-rank{r}", watch)
        for r, (a, h) in enumerate(zip(actors, how, strict=True), 1)
    ]
    watch.add(calls)
    return actors, calls


def test_a_follower_that_dies_is_reported_within_a_second_naming_its_rank():
    init_ray()
    watch, lost = _watch()
    actors, _ = _calls(watch, ["serve", "serve"])
    time.sleep(1.0)  # both calls are running and watched
    assert lost == []
    killed = time.monotonic()
    ray.kill(actors[1])
    wait_until(lambda: lost, 10, "the watch to report the dead follower")
    took = time.monotonic() - killed
    print(f"watch reported the kill after {took:.2f} s")
    assert took < 5.0
    (message,) = lost
    assert message.startswith("tensor-parallel rank 2 (g-rank2) died: ") and "Actor" in message
    assert watch.died(0) == message and watch.failure is None
    ray.kill(actors[0])


def test_a_follower_whose_load_raised_is_a_failure_not_a_lost_group():
    init_ray()
    watch, lost = _watch()
    actors, _ = _calls(watch, ["raise"])
    wait_until(lambda: watch.failure, 30, "the watch to see the follower's error")
    assert "tensor-parallel rank 1 (g-rank1) failed: " in watch.failure
    assert "rank 1 cannot read its shard" in watch.failure
    assert lost == [] and watch.died(0) is None
    ray.kill(actors[0])


def test_a_model_rank_zero_closed_or_gave_up_is_no_longer_watched():
    init_ray()
    watch, lost = _watch()
    actors, calls = _calls(watch, ["serve", "serve"])
    calls[0].kill()  # rank 0 abandoned the model: its follower's call is not the group's concern now
    calls[1].wait(timeout=0.1)  # rank 0 closed the model (the call outlives the wait here: it is logged)
    for actor in actors:
        ray.kill(actor)
    time.sleep(3.0)
    assert lost == []
