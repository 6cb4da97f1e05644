"""Tensor-parallel ranks of one engine: rank 0 runs the Engine (scheduler, sampler, requests); ranks
1..N-1 hold their shard of the weights and of the KV cache and run the same forward for every step.

The data plane is the model's own collectives (sharding.py: all-reduces and the head's gather; gloo on
CPU, NCCL on CUDA), each bounded by the group's timeout, so a rank that dies or hangs mid-step fails the
step on every rank instead of blocking it. The control plane is the rendezvous store: once per step rank 0
publishes the step plan as one packed int64 tensor (plan_codec.py: per scheduled sequence its position,
tokens and new block-table entries) and the followers rebuild light stand-ins of those sequences for
their own ModelRunner, so its packing, block-table and logits-row logic exists once. A follower waits
for the next plan in short polls: an idle leader keeps it waiting without a timeout, a dead leader (whose process hosts the store)
ends it. Rank 0 waits for its followers in short polls too (their arrival at the rendezvous, their load's
report), and between two it looks at the followers it started: one that ended fails the group (RankLost,
naming it) instead of leaving rank 0 in the rendezvous's START_TIMEOUT_S.

How the followers start is the caller's launcher: ProcessLauncher (the default) starts them as processes
of this machine; a Ray worker's placed group (runtime/groups.py) has follower actors that join the
rendezvous of every model its rank 0 loads.

The plan also carries what a follower cannot decide alone. With overlapped steps (engine.py) rank 0
launches a step before its host has read the previous step's tokens: their stand-ins (negative ids) are
in the plan, and the tokens themselves follow as one broadcast from rank 0's device, queued behind its
sampling (no host sync), so every rank's forward reads the same tokens. And the decode-graph bucket rank 0
replays (decode_graphs.py; 0, 0 for the packed path): every rank runs that bucket, so the padded batch
its collectives carry is the same on every rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from bulkgen.engine.config import EngineConfig
from bulkgen.engine.parallel.lora_tp import follow, publish, row_parallel_reduce, shard_pair
from bulkgen.engine.parallel.plan_codec import FollowedStep, PlanDecoder, PlanEncoder
from bulkgen.engine.parallel.replay_watchdog import ReplayWatchdog
from bulkgen.engine.process_memory import peak_rss, reset_peak_rss

DEFAULT_TIMEOUT_S = 300.0
START_TIMEOUT_S = 600.0  # for every rank to join the group
POLL_S = 1.0  # a store wait's slice: between two, rank 0 looks at the followers it started
_STOP = b"stop"


class RankLost(RuntimeError):
    """A collective failed: a rank of the group died or hung past the timeout. The group cannot go on;
    whoever runs it treats it as one lost worker."""


class RankGroup:
    """This process's membership of a tensor-parallel group: its collectives and the plan channel."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world: int,
        device: torch.device,
        timeout_s: float,
        followers: list | None = None,
    ):
        self.store, self.rank, self.world, self.device = store, rank, world, device
        self.processes: list = list(followers or [])  # the followers this rank started (Launcher.start)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds each rank's communicator to its current device
        # a process group of its own, not torch.distributed's default one: a process may hold several
        # joining waits for every rank's start; each collective waits at most `timeout_s`
        self.timeout = timedelta(seconds=timeout_s)
        start = max(timeout_s, START_TIMEOUT_S)
        self._arrive(
            start
        )  # every rank is here, or a follower that ended is named, before the blocking start
        self.group = _process_group(dist.PrefixStore("collectives", store), rank, world, device, start)
        self.steps = 0
        self.overlapped = 0  # steps that read the previous step's tokens by broadcast (overlapped steps)
        self.encoder, self.decoder = PlanEncoder(), PlanDecoder()  # rank 0's, a follower's
        self.watchdog = ReplayWatchdog(timeout_s)  # graph steps: their collectives are NCCL's blind spot
        self.loras = None  # this rank's lora_slots.LoraSlots, which registers itself (lora_tp.py)
        self.vlm = None  # a vision-language model's whole module (vision_shards.py): encoder on rank 0 only
        self.states = None  # a hybrid model's state_slots.StatePool: rank 0 sends each sequence's slot

    @classmethod
    def join(
        cls,
        host: str,
        port: int,
        rank: int,
        world: int,
        device: str,
        timeout_s: float,
        store=None,
        followers: list | None = None,
    ) -> RankGroup:
        """Rank 0 hosts the store on `host:port` (or passes the one it opened: `store`); the others connect
        to it. Joining waits for every rank (the process group's rendezvous); rank 0 watches `followers`
        (the ranks it started) meanwhile, and one that ended fails the join (RankLost, naming it)."""
        store = store or cls.open_store(host, port, rank, world, timeout_s)
        return cls(store, rank, world, torch.device(device), timeout_s, followers)

    def _arrive(self, start_s: float) -> None:
        """Say this rank is here; rank 0 then waits for every follower to say so, in short polls between
        which it looks at the followers it started: one that ended before joining fails the group at once,
        instead of leaving rank 0 in the process group's rendezvous for `start_s` (it cannot be cut)."""
        self.store.set(f"arrived/{self.rank}", b"1")
        if self.rank != 0:
            return
        deadline = time.monotonic() + start_s
        for rank in range(1, self.world):
            while not self._poll(f"arrived/{rank}"):
                if time.monotonic() > deadline:
                    raise RankLost(
                        f"tensor-parallel rank {rank} did not join the group within {start_s:.0f} s"
                    )

    @staticmethod
    def open_store(host: str, port: int, rank: int, world: int, timeout_s: float) -> dist.TCPStore:
        """The rendezvous store: hosted by rank 0 (port 0: one the OS picks, read back as `.port`, so no
        other socket can take it between choosing and binding), reached by the others. Its waits may take
        as long as a rank's start (imports, another rank's load): START_TIMEOUT_S, not the collectives'."""
        start = timedelta(seconds=max(timeout_s, START_TIMEOUT_S))
        return dist.TCPStore(host, port, world, is_master=rank == 0, timeout=start, wait_for_workers=False)

    def publish_config(self, config: EngineConfig, max_model_len: int) -> None:
        """Rank 0's resolved limits: every rank sizes its runner (slots, KV blocks) from the same ones (a
        follower, which received them, has nothing to publish)."""
        if self.rank == 0:
            self.store.set("config", json.dumps({"config": asdict(config), "max_model_len": max_model_len}))

    def receive_config(self) -> tuple[EngineConfig, int] | None:
        """Rank 0's limits, or None when rank 0 gave the model up (abandon)."""
        raw = self._wait("config")
        if raw == _STOP:
            return None
        raw = json.loads(raw)
        return EngineConfig(**raw["config"]), raw["max_model_len"]

    def abandon(self) -> None:
        """Rank 0 failed to load: followers waiting for its limits return instead of waiting on (a
        follower actor outlives the model and serves the next one)."""
        self.store.set("config", _STOP)

    def rank_memory(self) -> list[dict]:
        """Each rank's host memory at load (load_shard), in rank order."""
        return [json.loads(self._wait(f"memory/{rank}")) for rank in range(self.world)]

    def shard_lora(
        self, model, module: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) of an adapter's `module` (lora.load_adapter asks; lora_tp.shard_pair)."""
        return shard_pair(model, module, a, b)

    def lora_reduce(self, model, module: str):
        """The all-reduce a LoRA layer on `module` needs, or None (lora_slots asks; lora_tp.py)."""
        return row_parallel_reduce(model, module)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Sum (or `op`) `tensor` over the ranks, in place; RankLost after the group's timeout."""
        _wait(self.group.allreduce([tensor], op, self.timeout), self.rank)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, concatenated along the last dimension in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        _wait(self.group.allgather(parts, tensor.contiguous(), self.timeout), self.rank)
        return torch.cat(parts, dim=-1)

    def agree_min(self, value: int) -> int:
        """The smallest `value` over the ranks (a KV block count every rank's memory holds)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank, in place; RankLost after the group's timeout."""
        options = dist.BroadcastOptions()
        options.rootRank, options.timeout = 0, self.timeout
        _wait(self.group.broadcast([tensor], options), self.rank)
        return tensor

    @contextmanager
    def step(
        self, batch: list, pending: torch.Tensor | None = None, graph: tuple[int, int] | None = None
    ) -> Iterator[None]:
        """Rank 0: publish this step's (sequence, new tokens) pairs, the previous step's sampled tokens
        its stand-ins read (`pending`) and its decode-graph bucket, then run it. A failure once the
        other ranks are in the step leaves them waiting in a collective this rank left, so any error
        in it is RankLost: the group cannot take another step. A step that replays a CUDA graph is
        watched until the device finishes it (replay_watchdog.py)."""
        if self.rank == 0:
            rows = 0 if pending is None else pending.numel()
            if self.loras is not None:
                publish(self.loras, self.store)  # each new adapter's folder, before a plan names it
            self._post(self.encoder.encode(batch, rows, graph, self.loras, self.states))
            if pending is not None:
                self.broadcast(pending.to(torch.int64))
        try:
            yield
        except RankLost:
            raise
        except Exception as exc:
            raise RankLost(
                f"tensor-parallel rank {self.rank} failed a step: {type(exc).__name__}: {exc}"
            ) from exc
        if graph is not None and self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            self.watchdog.watch(done)

    def receive_plan(self) -> FollowedStep | None:
        """The next step as this follower runs it, or None when rank 0 closes the group."""
        if self.steps:  # the previous step is launched: its plan is no longer needed here
            self._release(self.steps - 1)
        raw = self._wait(f"plan/{self.steps}")
        self.steps += 1
        if raw == _STOP:
            return None
        batch, rows, graph = self.decoder.decode(raw)
        if self.decoder.loras is not None and self.loras is not None:
            follow(self.loras, self.decoder.loras, self.store)  # rank 0's adapters in rank 0's slots
        pending = None
        if rows:  # rank 0 broadcasts them right after the plan
            pending = self.broadcast(torch.empty(rows, dtype=torch.int64, device=self.device))
            self.overlapped += 1
        return FollowedStep(batch, pending, graph)

    def report(self, replays: Counter) -> None:
        """A follower's account of what it ran, published as it leaves (read with `reports`): its steps,
        how many read stand-in tokens by broadcast, and its decode-graph replays per bucket."""
        ran = {"steps": self.steps - 1, "overlapped": self.overlapped, "replays": _keyed(replays)}
        self.store.set(f"ran/{self.rank}", json.dumps(ran))

    def reports(self) -> list[dict]:
        """Each follower's `report`, in rank order, once `close` has stopped them (a follower that died
        never reports: the store's wait fails after the group's timeout instead of hanging)."""
        keys = [f"ran/{rank}" for rank in range(1, self.world)]
        self.store.wait(keys, self.timeout)
        return [json.loads(self.store.get(key)) for key in keys]

    def close(self) -> None:
        """Rank 0 tells the followers to exit; every rank leaves the process group."""
        self.watchdog.close()
        if self.rank == 0:
            self._post(_STOP)
        for follower in self.processes:
            follower.wait(timeout=30)

    def _post(self, payload: bytes) -> None:
        self.store.set(f"plan/{self.steps}", payload)
        self.steps += 1

    def _release(self, step: int) -> None:
        """A follower is done with plan `step`; the last one to be deletes it. Rank 0 cannot tell when
        every follower has read a plan: its host runs ahead of the collectives (overlapped steps, steps
        without sampling, NCCL's asynchronous collectives), so it never deletes one itself."""
        if self.store.add(f"read/{step}", 1) == self.world - 1:
            self.store.delete_key(f"plan/{step}")
            self.store.delete_key(f"read/{step}")

    def _wait(self, key: str) -> bytes:
        while not self._poll(key):
            pass
        return self.store.get(key)

    def _poll(self, key: str) -> bool:
        """Whether `key` is in the store, after up to a second's wait; RankLost when a follower this rank
        started has ended meanwhile (its key may never come)."""
        try:
            self.store.wait([key], timedelta(seconds=POLL_S))
            return True
        except dist.DistStoreError as exc:  # a poll that timed out; a lost store raises otherwise
            if "timeout" not in str(exc).lower():
                raise
        for rank, follower in enumerate(self.processes, 1):
            if (why := _ended(follower)) is not None:
                raise RankLost(f"tensor-parallel rank {rank} {why}")
        return False


def _ended(follower) -> str | None:
    """How a follower this rank started ended (a process's exit code), or None while it runs; a follower
    that cannot tell (a Ray actor's call: runtime/groups.py watches those itself) runs."""
    poll = getattr(follower, "poll", None)
    code = poll() if callable(poll) else None
    return None if code is None else f"exited with code {code}"


def _keyed(replays: Counter) -> dict[str, int]:
    """A replay count per bucket as JSON keys ("batch,width")."""
    return {f"{b},{w}": n for (b, w), n in sorted(replays.items())}


def load_shard(
    path: str | Path, group: RankGroup, dtype: torch.dtype, quantize: str | None = None
) -> torch.nn.Module:
    """This rank's shard of the model (`quantize`: its decoder layers' linears quantized, sharding.py), and
    what loading it cost in host memory, published for rank 0 (RankGroup.rank_memory): the resident set
    before, its peak while loading, and the weights' bytes as held."""
    from transformers import AutoConfig

    from bulkgen.engine.parallel.sharding import build_shard_model
    from bulkgen.engine.parallel.vision_shards import build_vision_shard

    before = reset_peak_rss()
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if getattr(config, "vision_config", None) is not None:
        model = build_vision_shard(path, config, group, dtype, quantize)
    else:
        model = build_shard_model(path, group, dtype, quantize)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    memory = {"rank": group.rank, "pid": os.getpid(), "device": str(group.device), "rss_before": before}
    memory.update(peak_rss=peak_rss(), weight_bytes=weights)
    group.store.set(f"memory/{group.rank}", json.dumps(memory))
    return model


def _wait(work, rank: int) -> None:
    try:
        work.wait()
    except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection, or the timeout passed
        raise RankLost(
            f"tensor-parallel rank {rank}: a collective failed ({' '.join(str(exc).split())[:200]})"
        ) from None


def _process_group(store: dist.Store, rank: int, world: int, device: torch.device, timeout_s: float):
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, options)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r of this node's visible GPUs, or the CPU."""
    return f"cuda:{rank}" if device.startswith("cuda") else "cpu"


class Follower(Protocol):
    """A started follower rank: joined when the group closes, killed when rank 0 fails to load."""

    def wait(self, timeout: float | None = None) -> object: ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    """How a group's follower ranks start, once per model rank 0 loads."""

    def device(self, device: str, rank: int) -> str:
        """Rank `rank`'s torch device, as that rank's process sees its devices."""

    def start(self, specs: list[dict]) -> list[Follower]:
        """Start ranks 1..N-1, each running serve_rank(**spec) with its own spec."""


class ProcessLauncher:
    """Followers as fresh interpreters of this machine (not multiprocessing's spawn, which re-imports the
    caller's __main__); rank r uses the r-th visible GPU."""

    def device(self, device: str, rank: int) -> str:
        return rank_device(device, rank)

    def start(self, specs: list[dict]) -> list[subprocess.Popen]:
        return [subprocess.Popen([sys.executable, "-m", __name__, json.dumps(spec)]) for spec in specs]


def serve_rank(
    path: str,
    rank: int,
    world: int,
    host: str,
    port: int,
    device: str,
    dtype: str,
    threads: int,
    timeout_s: float,
    quantize: str | None = None,
) -> None:
    """A follower rank's life for one model: join, load its shard on `device`, size its runner like rank
    0's, then run every step rank 0 publishes until it closes the group."""
    from bulkgen.engine.features.multimodal import VisionTower
    from bulkgen.engine.model_runner import ModelRunner

    torch.set_num_threads(threads)
    group = RankGroup.join(host, port, rank, world, device, timeout_s)
    model = load_shard(path, group, getattr(torch, dtype), quantize)
    if (limits := group.receive_config()) is None:
        return
    vision = None if group.vlm is None else VisionTower(group.vlm)  # image rows come from rank 0
    runner = ModelRunner(model, *limits, vision)
    while (step := group.receive_plan()) is not None:
        runner.follow(step.batch, step.pending, step.graph)
    group.report(runner.graphs.replays if runner.graphs is not None else Counter())


def launch(
    path: str | Path,
    world: int,
    device: str,
    dtype: torch.dtype,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    launcher: Launcher | None = None,
    quantize: str | None = None,
):
    """Start ranks 1..world-1 with `launcher` (processes of this machine by default; one torch thread each
    on CPU, unless this process uses more) and load rank 0's shard here; returns rank 0's model, its
    group attached as `model.bulkgen_tp`, and the followers as `group.processes`."""
    from transformers import AutoConfig

    from bulkgen.engine.parallel.sharding import check_splittable

    check_splittable(AutoConfig.from_pretrained(path, local_files_only=True), world)  # before any rank starts
    launcher = launcher or ProcessLauncher()
    store = RankGroup.open_store("127.0.0.1", 0, 0, world, timeout_s)  # before the followers: its port
    spec = dict(path=str(path), world=world, host="127.0.0.1", port=store.port)
    spec.update(dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads(), timeout_s=timeout_s)
    spec.update(quantize=quantize)
    followers = launcher.start(
        [{**spec, "rank": r, "device": launcher.device(device, r)} for r in range(1, world)]
    )
    group = None
    try:
        group = RankGroup.join(
            "127.0.0.1", store.port, 0, world, launcher.device(device, 0), timeout_s, store, followers
        )
        return load_shard(path, group, dtype, quantize)
    except BaseException:
        if group is not None:
            group.abandon()
        for follower in followers:  # a rank waiting for a group that will never run
            follower.kill()
        raise


if __name__ == "__main__":
    serve_rank(**json.loads(sys.argv[1]))
