"""A tensor-parallel worker on a real local Ray: one worker of two gloo ranks, placed as a group (a
STRICT_PACK placement group, rank 0 the worker actor, rank 1 a follower actor), runs a batch. A rank's
actor is killed mid-batch: the step fails on the ranks left within the collective timeout, the whole
group counts as one lost worker, its actors and placement group are removed, a new group is placed, and
every custom_id comes back exactly once. Both ranks are killed in turn, on one service, after the group
has switched models: its follower actor serves every model rank 0 loads."""

from __future__ import annotations

import json
import urllib.request

import pytest
import ray
from ray.util.placement_group import placement_group_table

from bulkgen.lab.tiny import build_tiny_model
from bulkgen.models.registry import EVERY_MODEL
from bulkgen.runtime.pool import NAMESPACE
from bulkgen.settings import Settings, WorkerSettings
from tests.runtime.test_faults import _assert_exactly_once, _create, _held_rows, _rows
from tests.support.service import MODEL, Service, completion_row, random_model, read_lines, wait_for
from tests.support.wait import wait_until

GROUP = "bulkgen-worker-0-tp2"  # worker 0's rank 0; its follower is GROUP-rank1
OTHER = "bulkgen-tiny-other"  # the random model's shape, other weights


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    engine = {
        "max_num_seqs": 32,
        "max_num_batched_tokens": 512,
        "collective_timeout_s": 30,
    }
    service = Service(
        Settings(
            storage=str(tmp_path_factory.mktemp("tp") / "store"),
            models={MODEL: str(random_model()), OTHER: str(_other_model(tmp_path_factory))},
            range_size=16,
            workers=WorkerSettings(cpu_workers=1, engine_kwargs=engine, tensor_parallel={EVERY_MODEL: 2}),
        )
    )
    yield service
    service.stop()


def _other_model(tmp_path_factory):
    shape = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    folder = tmp_path_factory.mktemp("other") / "model"
    return build_tiny_model(folder, arch="llama", seed=99, intermediate_size=256, **shape)


def _ranks(service) -> list[dict] | None:
    url = f"{service.base_url}/dashboard/workers"
    workers = json.loads(urllib.request.urlopen(url, timeout=30).read())["data"]
    return next(w for w in workers if w["index"] == 0)["ranks"]


def _placements() -> dict[str, str]:
    """The group's placement groups ever made: id -> state (CREATED, REMOVED, ...)."""
    return {pg: row["state"] for pg, row in placement_group_table().items() if row["name"] == GROUP}


def _kill_mid_batch(service, tmp_path, engine_gate, victim: str) -> None:
    """Hold a batch mid-run, kill the actor named `victim`, and check what the group's loss must keep."""
    client = service.client()
    rows = _held_rows("h", 16, max_tokens=32) + _rows("k", 48, 8)
    batch = _create(client, tmp_path / "tp.jsonl", rows)
    wait_for(client, batch.id, lambda b: b.request_counts.completed >= 16, timeout=300)
    engine_gate.wait_held()
    ranks = wait_until(lambda: _ranks(service), 60, "the worker's ranks on the dashboard")
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["device"] == "cpu" for r in ranks)
    assert all(r["weight_bytes"] > 0 and r["node"] and r["gpus"] == [] for r in ranks)
    assert len({(r["node"], r["node_ip"]) for r in ranks}) == 1  # STRICT_PACK: one node
    rank0, rank1 = ray.get_actor(GROUP, NAMESPACE), ray.get_actor(f"{GROUP}-rank1", NAMESPACE)
    assert ray.get(rank1.where.remote())["pid"] == ranks[1]["pid"] != ranks[0]["pid"]
    (placed,) = [pg for pg, state in _placements().items() if state == "CREATED"]
    ray.kill(rank0 if victim == GROUP else rank1)
    engine_gate.open()  # the next step needs both ranks: it fails, and the group with it
    batch = wait_for(client, batch.id, lambda b: b.status in {"completed", "failed"}, timeout=400)
    assert batch.status == "completed" and batch.request_counts.failed == 0
    _assert_exactly_once(client, batch, rows)
    replaced = wait_until(lambda: _ranks(service), 120, "the new group's ranks")
    assert {r["pid"] for r in replaced}.isdisjoint(r["pid"] for r in ranks)
    assert _placements()[placed] == "REMOVED"  # the lost group's placement group, and its actors with it
    for actor in (rank0, rank1):
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.where.remote() if actor is rank1 else actor.poll.remote("", 0.0), timeout=60)


def _greedy(service, tmp_path, model: str) -> dict[str, list]:
    """A small greedy batch on `model`: each custom_id's completion text (and the worker's rank 1 pid)."""
    client = service.client()
    rows = [
        completion_row(f"{model}-{i}", f"item {i} " * (1 + i), max_tokens=8, model=model) for i in range(8)
    ]
    batch = _create(client, tmp_path / f"{model}.jsonl", rows)
    batch = wait_for(client, batch.id, lambda b: b.status in {"completed", "failed"}, timeout=300)
    assert batch.status == "completed" and batch.request_counts.failed == 0
    texts = {
        line["custom_id"].split("-")[-1]: line["response"]["body"]["choices"][0]["text"]
        for line in read_lines(client, batch.output_file_id)
    }
    return texts, _ranks(service)[1]["pid"]


def test_a_group_switches_models_on_the_same_follower_actor(service, tmp_path):
    """Greedy tokens of the first model are the same after the group served another one: its follower
    joined each model's rendezvous (rank 0 closed the previous model first) with the right shard."""
    first, pid = _greedy(service, tmp_path, MODEL)
    other, pid_other = _greedy(service, tmp_path, OTHER)
    again, pid_again = _greedy(service, tmp_path, MODEL)
    assert again == first and other != first
    follower = ray.get(ray.get_actor(f"{GROUP}-rank1", NAMESPACE).where.remote())
    assert pid == pid_other == pid_again == follower["pid"]
    assert follower["serving"] == 1  # the models left behind were closed, not left waiting


def test_a_killed_follower_takes_its_group_down_and_the_batch_completes_exactly_once(
    service, tmp_path, engine_gate
):
    _kill_mid_batch(service, tmp_path, engine_gate, f"{GROUP}-rank1")


def test_a_killed_rank_zero_takes_its_followers_and_placement_group_with_it(service, tmp_path, engine_gate):
    _kill_mid_batch(service, tmp_path, engine_gate, GROUP)
