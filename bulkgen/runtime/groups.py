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
ends the followers with it, and the pool replaces a lost group by placing a new one.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from bulkgen.runtime import node_ip

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 30.0  # for a follower to say where it runs


class RankActor:
    """Rank r ≥ 1 of a placed group. A threaded actor (max_concurrency), so `where` answers while a model
    is served and a serve call of a model rank 0 gave up never blocks the next model's."""

    def __init__(self) -> None:
        self._serving = 0  # models this rank follows now: 1 while rank 0 has one loaded
        self._lock = threading.Lock()

    def serve(self, spec: dict) -> None:
        """Follow rank 0 through one model: join its rendezvous, load this rank's shard, run its steps
        until rank 0 closes the group (or gives the model up)."""
        from bulkgen.engine.tensor_parallel import serve_rank

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
    """A follower actor's serve call for one model (tensor_parallel.Follower)."""

    def __init__(self, ref: ray.ObjectRef) -> None:
        self.ref = ref

    def wait(self, timeout: float | None = None) -> None:
        try:
            ray.get(self.ref, timeout=timeout)
        except Exception as exc:  # a lost follower: rank 0 has seen it as RankLost already
            log.warning("a tensor-parallel follower ended with %s", type(exc).__name__)

    def kill(self) -> None:
        """Nothing to end: the actor stays for the next model, and its serve call returns once rank 0
        abandons the model (tensor_parallel.launch)."""


class FollowerLauncher:
    """tensor_parallel.Launcher for a placed group: its follower actors join each model's rendezvous."""

    def __init__(self, followers: list) -> None:
        self.followers = followers

    def device(self, device: str, rank: int) -> str:
        return "cuda:0" if device.startswith("cuda") else "cpu"  # each actor sees its own GPU only

    def start(self, specs: list[dict]) -> list[_Serving]:
        return [_Serving(actor.serve.remote(spec)) for actor, spec in zip(self.followers, specs, strict=True)]

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
            ray.remote(RankActor)
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
        group.worker = make_worker(
            _in_bundle(group.placement, 0, shape[0]), FollowerLauncher(group.followers)
        )
        return group
    except BaseException:
        remove_placement_group(group.placement)
        raise


def _in_bundle(placement: PlacementGroup, index: int, bundle: dict[str, float]) -> dict[str, Any]:
    """Actor options that put an actor in bundle `index` and take the whole bundle."""
    strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=index)
    return {"num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0), "scheduling_strategy": strategy}
