"""Ray setup and the pool of engine worker actors: one per GPU (num_gpus=1), CPU actors without GPUs.

Actors are named `bulkgen-worker-<n>` in the Ray namespace `bulkgen`, so operators can find them with
`ray list actors` or `ray.get_actor("bulkgen-worker-0", namespace="bulkgen")`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import ray

from bulkgen.runtime.worker import EngineWorker

NAMESPACE = "bulkgen"
log = logging.getLogger(__name__)


@dataclass
class PoolConfig:
    ray_address: str | None = None       # None: start a local Ray; "auto" or ray://…: join a cluster
    num_workers: int | None = None       # None: one per GPU, else `cpu_workers`
    cpu_workers: int = 1
    cpu_threads: int | None = None       # torch threads per CPU worker (Ray sets 1 otherwise)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def init_ray(address: str | None = None) -> None:
    """Join `address`, or start a small local Ray that leaves memory to the engine."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        return
    ray.init(
        namespace=NAMESPACE,
        num_cpus=max(2, os.cpu_count() or 1),
        include_dashboard=False,
        object_store_memory=256 * 1024 * 1024,
        log_to_driver=False,
        configure_logging=False,
    )


class WorkerPool:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.workers: list = []

    def start(self) -> list:
        init_ray(self.config.ray_address)
        gpus = int(ray.cluster_resources().get("GPU", 0))
        count = self.config.num_workers or gpus or self.config.cpu_workers
        use_gpu = gpus > 0
        threads = self.config.cpu_threads or (None if use_gpu else max(1, (os.cpu_count() or 1) // count))
        actor = ray.remote(EngineWorker)
        for index in range(count):
            options = {"num_gpus": 1} if use_gpu else {"num_cpus": 1}
            handle = actor.options(
                name=f"bulkgen-worker-{index}", namespace=NAMESPACE, get_if_exists=True,
                max_concurrency=4, max_restarts=0, **options,
            ).remote(index, self.config.engine_kwargs, threads)
            self.workers.append(handle)
        log.info("started %d %s worker(s)", count, "GPU" if use_gpu else "CPU")
        return self.workers

    def load(self, model_name: str, model_path: str, endpoint_url: str | None = None) -> list[dict]:
        """Every worker loads `model_name` (a no-op where it is already loaded)."""
        return ray.get([w.load.remote(model_name, model_path, endpoint_url) for w in self.workers])

    def shutdown(self) -> None:
        for handle in self.workers:
            ray.kill(handle)
        self.workers = []
