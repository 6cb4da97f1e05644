"""A tensor-parallel worker as Ray places it: a placement group of N bundles on one node (STRICT_PACK),
one actor per rank.

Bundle 0 holds rank 0, the EngineWorker (scheduler, sampler, the driver's calls); bundles 1..N-1 hold a
RankActor each, which runs a follower rank (tensor_parallel.serve_rank) for every model rank 0 loads:
rank 0's engine starts its followers through a FollowerLauncher, which asks these actors to join the
model's rendezvous instead of spawning processes. On GPUs a bundle is one GPU and one CPU, and Ray sets
each actor's CUDA_VISIBLE_DEVICES to its own GPU, so every rank's device is cuda:0. On CPU (gloo ranks
prove correctness, they are no serving setup) the group's bundles share the CPUs one worker asks for, in
fractions, so a group is placed beside other workers on a small machine.

The group lives and dies as one: PlacedGroup.remove kills rank 0 and removes the placement group, which
ends the followers with it, and the pool replaces a lost group by placing a new one. Rank 0 watches its
followers while a model is live (FollowerWatch): a follower that dies ends rank 0 within a second, in the
load as in the steps, so the group is lost as one worker instead of waiting on a dead rank.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from bulkgen.runtime import node_ip

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0  # for a follower to say where it runs
WATCH_PERIOD_S = 0.5  # the follower watch takes up a new model's calls within this
# Tests set this to a RankActor subclass ("module:Class") whose load they can hold at a gate
# (tests/support/held_rank.py), so a follower can be killed while its group loads; as BULKGEN_TEST_ENGINE.
RANK_ACTOR_CLASS_ENV = "BULKGEN_TEST_RANK_ACTOR"


class RankActor:
    """Rank r ≥ 1 of a placed group. A threaded actor (max_concurrency), so `where` answers while a model
    is served and a serve call of a model rank 0 gave up never blocks the next model's."""

    def __init__(self) -> None:
        self._serving = 0  # models this rank follows now: 1 while rank 0 has one loaded
        self._lock = threading.Lock()

    def serve(self, spec: dict) -> None:
        """Follow rank 0 through one model: join its rendezvous, load this rank's shard, run its steps
        until rank 0 closes the group (or gives the model up)."""
        from bulkgen.engine.parallel.tensor_parallel import serve_rank

        with self._lock:
            self._serving += 1
        try:
            serve_rank(**spec)
        finally:
            with self._lock:
                self._serving -= 1

    def where(self) -> dict[str, Any]:
        """Where this rank runs, and how many models it follows (more than one: rank 0 left a model
        without closing it, and its rank waits on)."""
        return {**placement_of_this_process(), "serving": self._serving}


def rank_actor_class() -> type:
    """The class of a group's follower actors: RankActor, unless BULKGEN_TEST_RANK_ACTOR names another."""
    import importlib

    name = os.environ.get(RANK_ACTOR_CLASS_ENV)
    if not name:
        return RankActor
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def placement_of_this_process() -> dict[str, Any]:
    """Where this actor runs, for the dashboard: its pid, node and the GPUs Ray gave it."""
    context = ray.get_runtime_context()
    return {
        "pid": os.getpid(),
        "node": context.get_node_id(),
        "node_ip": node_ip(),
        "gpus": [str(g) for g in ray.get_gpu_ids()],
    }


class _Serving:
    """A follower actor's serve call for one model (tensor_parallel.Follower), watched while that model is
    live: from its start until rank 0 closes the model (`wait`) or gives it up (`kill`)."""

    def __init__(self, ref: ray.ObjectRef, rank: int, name: str, watch: FollowerWatch | None = None) -> None:
        self.ref, self.rank, self.name, self.watch = ref, rank, name, watch

    def wait(self, timeout: float | None = None) -> None:
        if self.watch is not None:
            self.watch.drop(self)  # rank 0 closes the model: its follower's call ends, as it should
        try:
            ray.get(self.ref, timeout=timeout)
        except Exception as exc:  # a lost follower: rank 0 has seen it as RankLost already
            log.warning("a tensor-parallel follower ended with %s", type(exc).__name__)

    def kill(self) -> None:
        """Nothing to end: the actor stays for the next model, and its serve call returns once rank 0
        abandons the model (tensor_parallel.launch). It is no longer watched."""
        if self.watch is not None:
            self.watch.drop(self)


class FollowerWatch:
    """Rank 0's watch on its followers (a thread of rank 0's actor): a follower actor that dies while a model
    is live (killed, out of memory, its process crashed) ends this process, so the group is lost as one
    worker at once, whatever rank 0 waits in: the rendezvous (up to 600 s), a collective (its timeout), the
    load, or nothing (an idle group). The dispatcher then puts the group's ranges back and the pool places a
    new group (PlacedGroup.remove ends the other ranks). Ray fails a dead actor's pending calls, so the watch
    waits on the followers' serve calls (`ray.wait`) instead of polling the actors. A serve call that raised
    (the follower's own code failed: its shard did not load) is remembered in `failure` instead: rank 0's
    load then fails as a model that cannot load, not as a lost group (engine_loop)."""

    def __init__(self, on_lost: Callable[[str], None] | None = None) -> None:
        self.on_lost = on_lost or _exit_group
        self.failure: str | None = None
        self.lost: str | None = None  # which rank died, and why
        self._died = threading.Event()
        self._calls: dict[ray.ObjectRef, _Serving] = {}
        self._lock = threading.Lock()
        self._added = threading.Event()
        threading.Thread(target=self._run, name="bulkgen-tp-watch", daemon=True).start()

    def add(self, calls: list[_Serving]) -> None:
        with self._lock:
            self._calls.update((call.ref, call) for call in calls)
        self._added.set()

    def drop(self, call: _Serving) -> None:
        with self._lock:
            self._calls.pop(call.ref, None)

    def died(self, within: float) -> str | None:
        """Which rank died and why, once the watch has seen it (waiting up to `within` s), else None."""
        self._died.wait(within)
        return self.lost

    def _run(self) -> None:
        while True:
            with self._lock:
                refs = list(self._calls)
            if not refs:
                self._added.wait()
                self._added.clear()
                continue
            try:
                ready, _ = ray.wait(refs, num_returns=1, timeout=WATCH_PERIOD_S)  # new calls join each period
            except Exception as exc:  # Ray shutting down in this process: nothing to watch for
                log.warning("tensor-parallel follower watch: %s: %s", type(exc).__name__, exc)
                time.sleep(WATCH_PERIOD_S)
                continue
            for ref in ready:
                with self._lock:
                    call = self._calls.pop(ref, None)
                if call is not None:
                    self._ended(call)

    def _ended(self, call: _Serving) -> None:
        """A live model's serve call ended: the follower died (the group is lost) or its code raised."""
        try:
            ray.get(call.ref, timeout=0)
        except ray.exceptions.RayActorError as exc:
            cause = " ".join(str(exc).split())[:300]
            self.lost = f"tensor-parallel rank {call.rank} ({call.name}) died: {type(exc).__name__}: {cause}"
            self._died.set()
            self.on_lost(self.lost)
            return
        except Exception as exc:
            cause = " ".join(str(getattr(exc, "cause", None) or exc).split())[:300]
            self.failure = f"tensor-parallel rank {call.rank} ({call.name}) failed: {cause}"
            log.error("%s", self.failure)
            return
        # returned: rank 0 posted the model's end (close) and its wait has not dropped the call yet
        log.debug("tensor-parallel rank %d (%s) left its model", call.rank, call.name)


def _exit_group(message: str) -> None:
    """Rank 0's end when a follower died: as EngineLoop._die after a failed collective, the process exits and
    the group is replaced as one lost worker."""
    log.error("%s; rank 0 exits so the group is replaced", message)
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()
    os._exit(1)


class FollowerLauncher:
    """tensor_parallel.Launcher for a placed group: its follower actors join each model's rendezvous, and
    rank 0 watches them while a model is live (FollowerWatch, started in rank 0's process)."""

    def __init__(self, followers: list, names: list[str] | None = None) -> None:
        self.followers = followers
        self.names = names or [f"rank{r}" for r in range(1, len(followers) + 1)]
        self.watch: FollowerWatch | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "watch": None}  # the watch's thread is rank 0's, started there

    def device(self, device: str, rank: int) -> str:
        return "cuda:0" if device.startswith("cuda") else "cpu"  # each actor sees its own GPU only

    def start(self, specs: list[dict]) -> list[_Serving]:
        if self.watch is None:
            self.watch = FollowerWatch()
        ranks = zip(self.followers, self.names, specs, strict=True)
        calls = [
            _Serving(actor.serve.remote(spec), r, name, self.watch)
            for r, (actor, name, spec) in enumerate(ranks, 1)
        ]
        self.watch.add(calls)
        return calls

    def died(self, within: float) -> str | None:
        """Which follower died and why, if the watch sees it within `within` s (a collective may fail on the
        dead rank's closed connection before Ray reports the death)."""
        return None if self.watch is None else self.watch.died(within)

    def failure(self) -> str | None:
        """Why a follower's serve call raised (its own code failed), if one did since rank 0 started."""
        return None if self.watch is None else self.watch.failure

    def ranks(self, memory: list[dict]) -> list[dict]:
        """Each rank's load memory (tensor_parallel.RankGroup.rank_memory) with where it runs: rank 0 is
        this process, the others ask their actors."""
        where = [placement_of_this_process()]
        where += ray.get([actor.where.remote() for actor in self.followers], timeout=READY_TIMEOUT_S)
        return [{**rank, **place} for rank, place in zip(memory, where, strict=True)]


@dataclass
class PlacedGroup:
    """A tensor-parallel worker's actors and its placement group (None: a live group another pool placed
    under the same name, which that pool owns and replaces once its rank 0 is gone)."""

    worker: Any
    followers: list = field(default_factory=list)
    placement: PlacementGroup | None = None

    def remove(self) -> None:
        """Kill rank 0 and remove the placement group: Ray ends every actor placed in it."""
        try:
            ray.kill(self.worker)
        except Exception:  # already gone
            pass
        if self.placement is not None:
            remove_placement_group(self.placement)


def bundles(ranks: int, use_gpu: bool, cpus: float) -> list[dict[str, float]]:
    """One bundle per rank: a GPU and a CPU each, or on CPU a share of the `cpus` the group asks for
    (Ray takes fractions down to 1/10,000)."""
    if use_gpu:
        return [{"GPU": 1, "CPU": 1} for _ in range(ranks)]
    return [{"CPU": round(cpus / ranks, 4)} for _ in range(ranks)]


def place(
    name: str,
    namespace: str,
    ranks: int,
    use_gpu: bool,
    cpus: float,
    make_worker: Callable[[dict, FollowerLauncher], Any],
    runtime_env: dict | None = None,
) -> PlacedGroup:
    """Place a group of `ranks` under `name`: its followers `<name>-rank<r>` and rank 0 from
    `make_worker(actor options in bundle 0, launcher)`. A live rank 0 of that name is joined, not doubled."""
    try:
        return PlacedGroup(ray.get_actor(name, namespace=namespace))
    except ValueError:  # none yet
        pass
    shape = bundles(ranks, use_gpu, cpus)
    group = PlacedGroup(None, placement=placement_group(shape, strategy="STRICT_PACK", name=name))
    try:
        env = {"runtime_env": runtime_env} if runtime_env else {}
        group.followers = [
            ray.remote(rank_actor_class())
            .options(
                name=f"{name}-rank{r}",
                namespace=namespace,
                max_concurrency=4,
                max_restarts=0,
                **_in_bundle(group.placement, r, shape[r]),
                **env,
            )
            .remote()
            for r in range(1, ranks)
        ]
        names = [f"{name}-rank{r}" for r in range(1, ranks)]
        group.worker = make_worker(
            _in_bundle(group.placement, 0, shape[0]), FollowerLauncher(group.followers, names)
        )
        return group
    except BaseException:
        remove_placement_group(group.placement)
        raise


def _in_bundle(placement: PlacementGroup, index: int, bundle: dict[str, float]) -> dict[str, Any]:
    """Actor options that put an actor in bundle `index` and take the whole bundle."""
    strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index)
    return {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0), "scheduling_strategy": strategy}
