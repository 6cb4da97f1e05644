"""Ray setup and the pool of engine worker actors: one per GPU (num_gpus=1), CPU actors without GPUs.

Workers come in classes, one per rank count the served models use (`--tensor-parallel NAME=N`): a model's
ranges go only to workers of its count (workqueue.take), so a small model never occupies a group and a
large one never lands on a single GPU. The GPUs are split between the classes (`split_gpus`); without
GPUs each class has `--workers` (else `--cpu-workers`) CPU workers. Actors are named `bulkgen-worker-<n>` in the Ray namespace `bulkgen`, so operators can find them with
`ray list actors` or `ray.get_actor("bulkgen-worker-0", namespace="bulkgen")`; a tensor-parallel group of
N ranks is `bulkgen-worker-<n>-tp<N>` (rank 0; its followers `...-tp<N>-rank<r>`, all in one placement
group: runtime/groups.py), so a pool never takes over a live actor of another rank count (`get_if_exists`)
and runs a model on the wrong number of ranks. GPU actors are spread over the cluster's nodes; an actor
(or group) that dies is replaced under the same name by the dispatcher.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Collection
from pathlib import Path

import ray

from bulkgen.runtime import RayUnavailable, WorkersDoNotFit
from bulkgen.runtime.groups import PlacedGroup, place
from bulkgen.runtime.worker import EngineWorker
from bulkgen.settings import WorkerSettings

NAMESPACE = "bulkgen"
JOIN_TIMEOUT_S = 5.0
# A local Ray on a busy host: Ray's own start-up waits where it has a setting for them (an operator's own
# value wins), and the raylet's (30 s, hard-coded in ray._private.node) by starting again
RAY_START_WAITS = {
    "RAY_gcs_server_port_wait_time_s": "120",  # the GCS's port, then its client's connect (default 30)
    "RAY_gcs_server_request_timeout_seconds": "120",  # each GCS request while the node starts (default 60)
}
RAY_SYSTEM_CONFIG = {"worker_register_timeout_seconds": 180}  # a worker process's first call home (60)
RAY_START_ATTEMPTS = 3
log = logging.getLogger(__name__)


def init_ray(address: str | None = None) -> None:
    """Join `address` ("auto": this machine's cluster), or, without one, start a private local Ray on
    127.0.0.1 that leaves memory to the engine. Never a cluster nobody named: a `ray start` head on the
    same machine is not joined uninvited (Ray's own default would, then refuse our num_cpus).
    RayUnavailable (one line) if Ray cannot start or the cluster does not answer."""
    if ray.is_initialized():
        return
    try:
        if address:
            _join(address)
        else:
            _start_local()
    except RayUnavailable:
        raise
    except Exception as exc:
        what = f"cannot join the Ray cluster at {address}" if address else "cannot start a local Ray"
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise RayUnavailable(f"{what}: {reason}") from None


def _start_local(attempts: int = RAY_START_ATTEMPTS) -> None:
    """A private local Ray, started with waits that hold on a busy host, and started again when its node
    still times out (what it left behind is ended first): the last failure is raised."""
    for name, value in RAY_START_WAITS.items():
        os.environ.setdefault(name, value)
    for attempt in range(1, attempts + 1):
        before = _children()
        try:
            ray.init(
                address="local",
                namespace=NAMESPACE,
                num_cpus=max(2, os.cpu_count() or 1),
                include_dashboard=False,
                object_store_memory=256 * 1024 * 1024,
                log_to_driver=False,
                configure_logging=False,
                _node_ip_address="127.0.0.1",
                _system_config=RAY_SYSTEM_CONFIG,
            )
            return
        except Exception as exc:
            _end_started(before)
            if attempt == attempts or isinstance(exc, (TypeError, ValueError)):  # a bad argument: no retry
                raise
            log.warning(
                "local Ray did not start (%s); starting it again (%d of %d)", exc, attempt + 1, attempts
            )


def _children() -> set[int]:
    try:
        import psutil  # Ray's own copy (ray/thirdparty_files), on the path once ray is imported

        return {p.pid for p in psutil.Process().children(recursive=True)}
    except Exception:
        return set()


def _end_started(before: set[int]) -> None:
    """End the processes a failed start left (its GCS, raylet, reaper): this process's children that were
    not there before it, by their ids."""
    try:
        ray.shutdown()
    except Exception:
        pass
    try:
        import psutil

        for proc in psutil.Process().children(recursive=True):
            if proc.pid not in before:
                try:
                    proc.kill()
                except psutil.Error:
                    pass
    except Exception:
        pass


def _join(address: str) -> None:
    _check_answers(address)
    _use_token_auth_if_available()
    # Ray rewrites a loopback address to this host's IP unless told the driver's node is loopback too
    loopback = address.split("://")[-1].startswith(("127.", "localhost"))
    ray.init(
        address=address,
        namespace=NAMESPACE,
        log_to_driver=False,
        **({"_node_ip_address": "127.0.0.1"} if loopback else {}),
    )


def _check_answers(address: str) -> None:
    """Ray waits for a head that is not there for minutes, a warning every few seconds: look first."""
    host, _, port = address.split("://")[-1].rpartition(":")
    if not port.isdigit():  # "auto": Ray finds the machine's cluster itself, or says there is none
        return
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=JOIN_TIMEOUT_S).close()
    except OSError as exc:
        raise RayUnavailable(
            f"cannot join the Ray cluster at {address}: nothing answers there ({exc.strerror or exc})"
        ) from None


def _use_token_auth_if_available() -> None:
    """Ray 2.5x+ heads started with `ray start` enable token auth when a token exists, but a client
    given an explicit address sends its token only if RAY_AUTH_MODE=token: without it every call is
    refused (a warning a second, then ConnectionError). Turn token mode on when a token is at hand."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file():
        os.environ["RAY_AUTH_MODE"] = "token"
        try:  # the C++ config caches the mode when ray is imported; refresh it as `ray start` does
            from ray._raylet import Config

            Config.initialize("")
        except (ImportError, AttributeError):
            pass


def split_gpus(gpus: int, rank_counts: list[int]) -> dict[int, int]:
    """Workers of each rank count on `gpus` GPUs: one group of each first, then each class grows by whole
    groups, smallest groups first, up to an equal share of the GPUs (gpus / classes) while GPUs are left.
    So one model of each count always runs, and no class takes the others' share by default.
    WorkersDoNotFit when the GPUs cannot hold one group of each."""
    needed = sum(rank_counts)
    if needed > gpus:
        groups = " + ".join(f"one group of {n}" for n in rank_counts)
        raise WorkersDoNotFit(
            f"--tensor-parallel: {gpus} GPU(s) cannot hold {groups} ({needed} GPUs); "
            "lower a model's rank count or add GPUs"
        )
    counts = dict.fromkeys(rank_counts, 1)
    share, left = gpus // len(rank_counts), gpus - needed
    for ranks in sorted(rank_counts):
        more = min(max(0, share // ranks - 1), left // ranks)
        counts[ranks] += more
        left -= more * ranks
    return counts


class WorkerPool:
    def __init__(self, settings: WorkerSettings, rank_counts: list[int] | None = None) -> None:
        self.settings = settings
        self.rank_counts = sorted(set(rank_counts or [1]))  # one class of workers per rank count
        self.workers: list = []
        self.groups: dict[int, PlacedGroup] = {}  # a tensor-parallel worker's placed group, by index
        self.ranks: list[int] = []  # per worker: its class's rank count (a replacement keeps it)
        self.use_gpu = False
        self._threads: int | None = None
        # Ray CPUs each CPU worker asks for: one, a tensor-parallel group too (its ranks share it in
        # fractions, groups.bundles; gloo on CPU proves correctness, it is no serving setup), so a group is
        # placed beside other workers instead of waiting for a whole node's CPUs
        self._cpus = 1

    def start(self) -> list:
        init_ray(self.settings.ray_address)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        self.use_gpu = gpus > 0
        if self.settings.num_workers or not self.use_gpu:
            counts = dict.fromkeys(self.rank_counts, self.settings.num_workers or self.settings.cpu_workers)
        else:
            counts = split_gpus(gpus, self.rank_counts)
        self.ranks = [ranks for ranks, count in counts.items() for _ in range(count)]
        cpu_share = max(1, (os.cpu_count() or 1) // sum(self.ranks))
        self._threads = self.settings.cpu_threads or (None if self.use_gpu else cpu_share)
        self.workers = [self._create(i) for i in range(len(self.ranks))]
        log.info(
            "started %s %s worker(s)",
            ", ".join(f"{count} of {ranks} rank(s)" for ranks, count in counts.items()),
            "GPU" if self.use_gpu else "CPU",
        )
        return self.workers

    def count(self, ranks: int = 1) -> int:
        """Workers of the class of `ranks` ranks (those a model of that count shares its work among)."""
        return sum(1 for n in self.ranks if n == ranks)

    def _create(self, index: int):
        """Worker `index`'s actor: one per GPU, spread over the nodes; a tensor-parallel worker is a placed
        group of one actor per rank (runtime/groups.py), and this returns its rank 0."""
        ranks = self.ranks[index]
        engine = self.settings.engine_config(ranks)
        env = None
        if self._threads:  # Ray sets OMP_NUM_THREADS to the actor's num_cpus; the BLAS must see ours
            threads = str(self._threads)
            env = {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}}

        def make_worker(options: dict, launcher=None):
            actor = ray.remote(EngineWorker).options(
                name=self.actor_name(index),
                namespace=NAMESPACE,
                get_if_exists=True,
                max_concurrency=8,
                max_restarts=0,
                **({"runtime_env": env} if env else {}),
                **options,
            )
            args = (index, engine, self._threads, self.settings.images)
            return actor.remote(*args, **({"launcher": launcher} if launcher else {}))

        if ranks > 1:
            group = place(
                self.actor_name(index), NAMESPACE, ranks, self.use_gpu, self._cpus, make_worker, env
            )
            self.groups[index] = group
            return group.worker
        return make_worker(
            {"num_gpus": 1, "scheduling_strategy": "SPREAD"} if self.use_gpu else {"num_cpus": self._cpus}
        )

    def replace(self, index: int, attempts: int = 60):
        """A fresh actor (or placed group) under the dead one's name (its name frees once Ray has marked it
        dead); a lost group's actors and placement group are removed first, so none of it leaks."""
        self._remove(index)
        for _ in range(attempts):
            try:
                handle = self._create(index)
                # its process starts (imports torch: minutes on a busy host) within the load deadline's base
                started = ray.get(handle.poll.remote("", 0.0), timeout=self.settings.load_deadline_s)
                node = started.get("node_ip")
                self.workers[index] = handle
                log.warning("worker %d replaced, on %s", index, node)
                return handle
            except Exception as exc:  # the name is still taken by the dead actor, or no resources yet
                log.info("worker %d not replaceable yet: %s", index, exc)
                self.groups.pop(index, PlacedGroup(None)).remove()  # this attempt's group, if it placed one
                time.sleep(1.0)
        raise RuntimeError(f"could not replace {self.actor_name(index)}")

    def actor_name(self, index: int) -> str:
        """The Ray name of worker `index`: a tensor-parallel group's names its rank count."""
        ranks = self.ranks[index]
        return f"bulkgen-worker-{index}" + (f"-tp{ranks}" if ranks > 1 else "")

    def shutdown(self, keep: Collection[str] = ()) -> None:
        """End the workers, but those named in `keep` (Ray names: `actor_name`), which another pool in this
        Ray uses too: a pool's actors are named, and a second pool of the same names takes them over."""
        for index in range(len(self.workers)):
            if self.actor_name(index) not in keep:
                self._remove(index)
        self.workers = []

    def names(self) -> set[str]:
        """The Ray names of this pool's workers."""
        return {self.actor_name(index) for index in range(len(self.workers))}

    def _remove(self, index: int) -> None:
        """End worker `index`: its actor, or its group's actors and placement group."""
        group = self.groups.pop(index, None)
        if group is not None:
            group.remove()
            return
        try:
            ray.kill(self.workers[index])
        except Exception:  # already gone
            pass
