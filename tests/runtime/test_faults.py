"""Exactly once across faults, on a real local Ray: a killed worker, a SIGKILLed service, two replicas,
two batches at once, a cancelled queued batch, and a deleted input file."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import ray

from bulkgen.runtime.pool import NAMESPACE
from bulkgen.store import LocalStore
from tests.support.held_engine import HOLD
from tests.support.parts import envelopes
from tests.support.service import completion_row, read_lines, upload, wait_done, wait_for, write_jsonl
from tests.support.wait import wait_until

pytestmark = pytest.mark.slow


def _create(client, path: Path, rows: list[dict]):
    file_id = upload(client, write_jsonl(path, rows)).id
    endpoint = rows[0]["url"]
    return client.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window="24h")


def _rows(prefix: str, n: int, max_tokens: int) -> list[dict]:
    return [
        completion_row(f"{prefix}{i}", f"item {i} " * (1 + i % 5), max_tokens=max_tokens) for i in range(n)
    ]


def _assert_exactly_once(client, batch, rows: list[dict]) -> None:
    out, err = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    ids = [line["custom_id"] for line in out + err]
    assert sorted(ids) == sorted(r["custom_id"] for r in rows)  # every custom_id, none twice
    assert [line["custom_id"] for line in out] == [
        r["custom_id"]
        for r in rows
        if r["custom_id"] in set(ids) and any(o["custom_id"] == r["custom_id"] for o in out)
    ]
    assert batch.request_counts.completed == len(out) and batch.request_counts.failed == len(err)


def _parts(store: LocalStore, batch_id: str) -> dict[str, bytes]:
    return {k: store.read_bytes(k) for k in store.list(f"parts/{batch_id}/lines-")}


def _assert_kept(client, batch, before: dict[str, bytes]) -> None:
    """Results stored before a fault are the ones in the final output (finished work kept, not redone).
    Envelopes carry random ids, so this holds only where no range overlapping a stored part was redone:
    after a restart (coverage queues only lines without a part), not after a worker died mid-write."""
    final = {
        json.dumps(line, sort_keys=True)
        for line in read_lines(client, batch.output_file_id) + read_lines(client, batch.error_file_id)
    }
    kept = envelopes(before)
    assert kept and all(json.dumps(e, sort_keys=True) in final for e in kept)


def _held_rows(prefix: str, n: int, max_tokens: int = 200) -> list[dict]:
    """Requests held at the engine gate while it is closed (tests/support/held_engine.py); whole ranges
    (RANGE requests each), and more tokens than the unheld requests beside them take steps."""
    return [completion_row(f"{prefix}{i}", f"{HOLD} item {i}", max_tokens=max_tokens) for i in range(n)]


def _eta(batch) -> float | None:
    return ((batch.model_extra or {}).get("metrics") or {}).get("eta_s")


RANGE = 16  # the service's range size (tests/support/service.py settings_for)


def _some_parts(store, batch_id: str, timeout: float = 180) -> dict[str, bytes]:
    """Wait until some ranges are stored (counts move per request, parts per range)."""
    return wait_until(lambda: _parts(store, batch_id), timeout, f"a part of {batch_id}")


def test_a_killed_worker_is_replaced_and_nothing_is_lost_or_doubled(service, client, tmp_path, engine_gate):
    rows = _held_rows("h", RANGE) + _rows("k", 96, 8)  # the held range is still running when the worker dies
    batch = _create(client, tmp_path / "kill.jsonl", rows)
    # counts move as requests settle, the metrics (and the estimate) as their ranges are written
    running = wait_for(
        client, batch.id, lambda b: b.request_counts.completed >= 32 and _eta(b) is not None, timeout=180
    )
    engine_gate.wait_held()
    assert running.status == "in_progress" and _eta(running) is not None
    store = service.svc.store
    before = _some_parts(store, batch.id)
    workers = json.loads(urllib.request.urlopen(f"{service.base_url}/dashboard/workers", timeout=30).read())
    first = next(w for w in workers["data"] if w["index"] == 0)
    nodes = {node["NodeManagerAddress"] for node in ray.nodes()}
    assert first["node_ip"] in nodes and first["cpu_threads"] >= 1  # its node as Ray knows it, its threads
    ray.kill(ray.get_actor("bulkgen-worker-0", namespace=NAMESPACE))
    engine_gate.open()  # the replacement runs the held range to its end
    settled = []  # completed + failed as the client saw them: never above the total, whatever was lost
    terminal = {"completed", "failed", "expired", "cancelled"}
    batch = wait_for(
        client,
        batch.id,
        lambda b: (
            settled.append(b.request_counts.completed + b.request_counts.failed) or b.status in terminal
        ),
        timeout=300,
    )
    assert batch.status == "completed" and max(settled) <= len(rows)
    _assert_exactly_once(client, batch, rows)
    assert batch.request_counts.failed == 0
    assert before and _parts(store, batch.id) == {}  # the output is final: its parts are deleted


def test_two_batches_share_the_workers_and_a_small_one_is_not_starved(service, client, tmp_path):
    big_rows, small_rows = _rows("big", 450, 160), _rows("small", 10, 4)
    big = _create(client, tmp_path / "big.jsonl", big_rows)
    wait_for(client, big.id, lambda b: b.request_counts.completed >= 16, timeout=180)
    small = _create(client, tmp_path / "small.jsonl", small_rows)
    small = wait_done(client, small.id, timeout=180)
    assert client.batches.retrieve(big.id).status in (
        "in_progress",
        "finalizing",
    )  # done while the big one ran
    big = wait_done(client, big.id, timeout=300)
    _assert_exactly_once(client, small, small_rows)
    _assert_exactly_once(client, big, big_rows)
    # each batch's metrics count only its own requests and steps
    assert small.model_extra["metrics"]["requests"] == 10 and big.model_extra["metrics"]["requests"] == 450
    small_tokens = sum(w["steps"] for w in small.model_extra["metrics"]["per_worker"].values())
    big_tokens = sum(w["steps"] for w in big.model_extra["metrics"]["per_worker"].values())
    assert 0 < small_tokens < big_tokens


def test_concurrent_cancels_of_a_queued_batch_end_it_once(service, client, tmp_path, engine_gate):
    blocker = _create(client, tmp_path / "blocker.jsonl", _held_rows("b", 200, 64))  # fills the worker, held
    engine_gate.wait_held()
    rows = _rows("q", 40, 8)
    queued = _create(client, tmp_path / "queued.jsonl", rows)
    threads = [threading.Thread(target=client.batches.cancel, args=(queued.id,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queued = wait_done(client, queued.id, timeout=120)
    assert queued.status == "cancelled"
    _assert_exactly_once(client, queued, rows)
    names = [f.filename for f in client.files.list(purpose="batch_output").data]
    assert sum(queued.id in name for name in names) == (queued.output_file_id is not None) + 1
    runners = list(service.svc.store.list(f"parts/{queued.id}/runner-"))
    assert len(runners) == 1
    client.batches.cancel(blocker.id)
    wait_done(client, blocker.id, timeout=120)


def test_the_input_of_a_running_batch_cannot_be_deleted(client, tmp_path, engine_gate):
    rows = _held_rows("d", 60, 16)
    batch = _create(client, tmp_path / "del.jsonl", rows)
    engine_gate.wait_held()  # running, and held there until the gate opens
    with pytest.raises(openai.ConflictError, match="is the input of batch"):
        client.files.delete(batch.input_file_id)
    engine_gate.open()
    batch = wait_done(client, batch.id, timeout=180)
    assert batch.status == "completed" and len(read_lines(client, batch.output_file_id)) == 60
    assert client.files.delete(batch.input_file_id).deleted


def test_sigkill_of_the_service_resumes_from_written_parts(serve_process, tmp_path, engine_gate):
    storage = str(tmp_path / "store")
    first = serve_process(storage, "--lease-ttl", "4")
    client = first.client()
    rows = _held_rows("h", RANGE, 64) + _rows("s", 96, 8)
    batch = _create(client, tmp_path / "s.jsonl", rows)
    store = LocalStore(storage)
    wait_until(lambda: len(_parts(store, batch.id)) == 96 // RANGE, 180, "the unheld ranges' parts")
    engine_gate.wait_held()
    first.kill()
    before = _parts(store, batch.id)
    assert before and len(before) < len(rows) // RANGE  # the held range had no part yet
    engine_gate.open()
    second = serve_process(storage, "--lease-ttl", "4")
    batch = wait_done(second.client(), batch.id, timeout=300)
    assert batch.status == "completed"
    _assert_exactly_once(second.client(), batch, rows)
    assert _parts(store, batch.id) == {}  # the output is final: its parts are deleted
    _assert_kept(second.client(), batch, before)
    owners = [json.loads(store.read_bytes(k))["owner"] for k in store.list(f"parts/{batch.id}/runner-")]
    assert len(set(owners)) == 2  # the dead service's runner, then the new one


def test_two_replicas_on_one_storage_run_each_batch_once(serve_process, tmp_path):
    storage = str(tmp_path / "store")
    a, b = serve_process(storage), serve_process(storage)
    batches = [
        (_create(c, tmp_path / f"r{i}.jsonl", _rows(f"r{i}-", 48, 8)), _rows(f"r{i}-", 48, 8))
        for i, c in enumerate([a.client(), b.client(), a.client(), b.client()])
    ]
    store = LocalStore(storage)
    for batch, rows in batches:
        done = wait_done(a.client(), batch.id, timeout=300)
        assert done.status == "completed"
        _assert_exactly_once(a.client(), done, rows)
        assert len(list(store.list(f"parts/{batch.id}/runner-"))) == 1  # one runner, one finalize
    outputs = [f for f in a.client().files.list(purpose="batch_output").data]
    assert len(outputs) == len(batches)


def test_a_poison_line_costs_only_itself_and_no_other_batch(client, tmp_path):
    """A line at the edge of the seed range (seed 2**64-1 with n=2: the second completion's seed wraps)
    costs at most itself: its batch completes, and the next batch runs in full."""
    rows = _rows("p", 20, 8)
    rows.insert(7, completion_row("poison", "seeded", max_tokens=8, seed=2**64 - 1, n=2))
    batch = wait_done(client, _create(client, tmp_path / "poison.jsonl", rows).id, timeout=180)
    assert batch.status == "completed"
    _assert_exactly_once(client, batch, rows)
    failed = read_lines(client, batch.error_file_id)
    assert [e["custom_id"] for e in failed] in ([], ["poison"])  # refused alone, or run: never its neighbours
    assert batch.request_counts.completed >= 20
    later_rows = _rows("after", 4, 4)
    later = wait_done(client, _create(client, tmp_path / "after.jsonl", later_rows).id, timeout=180)
    assert later.request_counts.completed == 4 and later.request_counts.failed == 0


def _embedding_rows(prefix: str, lines: int, inputs: int = 2048) -> list[dict]:
    """Lines of `inputs` embedding inputs each: 24 of them are 49,152 inputs, under OpenAI's 50,000."""
    return [
        {
            "custom_id": f"{prefix}{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "bulkgen-tiny", "input": [f"text {i} {j} " * 5 for j in range(inputs)]},
        }
        for i in range(lines)
    ]


def _worker_held() -> int:
    """Requests the worker holds (being prepared, queued or in its engine), whatever batch they are of."""
    handle = ray.get_actor("bulkgen-worker-0", namespace=NAMESPACE)
    return ray.get(handle.poll.remote("test-probe", 0.0, False), timeout=60)["held"]


def _busy_ratio(service) -> float:
    text = (
        urllib.request.urlopen(service.base_url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    )
    return max(
        [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("bulkgen_worker_busy_ratio{")
        ]
        or [0.0]
    )


def _cancelled_and_let_go(client, batch, rows) -> None:
    """The batch ends cancelled with every line once (finished work kept, the rest batch_cancelled), and within
    a few steps the worker holds none of its requests: nothing of it is prepared, queued or embedded on."""
    batch = wait_done(client, batch.id, timeout=120)
    assert batch.status == "cancelled"
    _assert_exactly_once(client, batch, rows)
    assert batch.request_counts.total == len(rows)
    assert batch.request_counts.completed + batch.request_counts.failed == len(rows)
    wait_until(lambda: _worker_held() == 0, 30, "the worker to drop the cancelled batch's requests")


def test_a_cancelled_embeddings_batch_stops_on_the_worker_and_later_batches_run(service, client, tmp_path):
    """A big embeddings batch cancelled while its first range is being prepared (2,048 inputs a line, one
    engine request each), and another cancelled while the engine embeds it: each ends cancelled with its
    counts whole, the worker lets go of its requests within seconds (it went on embedding 31,000 inputs of
    the first for minutes, stepping for no batch, while the dashboard showed it idle), /metrics shows the
    worker busy while it embeds, and a chat batch created after the cancels completes promptly."""
    rows = _embedding_rows("pre", 24)
    batch = _create(client, tmp_path / "e1.jsonl", rows)
    wait_for(client, batch.id, lambda b: b.status != "validating", timeout=180)
    time.sleep(0.5)  # its first range is being read and tokenized on the worker
    client.batches.cancel(batch.id)
    _cancelled_and_let_go(client, batch, rows)

    rows = _embedding_rows("mid", 24)
    batch = _create(client, tmp_path / "e2.jsonl", rows)
    wait_until(lambda: _busy_ratio(service) > 0, 180, "/metrics to show the worker busy embedding")
    client.batches.cancel(batch.id)
    _cancelled_and_let_go(client, batch, rows)

    chat_rows = _rows("after", 8, 4)
    started = time.monotonic()
    later = wait_done(client, _create(client, tmp_path / "after.jsonl", chat_rows).id, timeout=120)
    assert later.status == "completed" and later.request_counts.completed == 8
    assert time.monotonic() - started < 60  # the worker's own: not behind ~49,000 orphaned embeddings


def test_an_internal_error_reaches_the_client_without_the_storage_path(
    service, client, tmp_path, monkeypatch
):
    """A runner that fails on an OS error (its message holds the path of a stored object) fails its batch with
    the error in the batch's errors, the storage's folder written `<storage>`: the log keeps the path."""
    from bulkgen.runtime.runner import BatchRunner

    root = str(service.svc.settings.storage)

    def broken(self, record):
        raise FileNotFoundError(
            2, "No such file or directory", f"{root}/parts/{self.batch_id}/lines-1-16.jsonl"
        )

    monkeypatch.setattr(BatchRunner, "_execute", broken)
    batch = _create(client, tmp_path / "broken.jsonl", _rows("x", 4, 2))
    batch = wait_done(client, batch.id, timeout=120)
    assert batch.status == "failed"
    [error] = batch.errors.data
    assert (
        "FileNotFoundError" in error.message
        and f"<storage>/parts/{batch.id}/lines-1-16.jsonl" in error.message
    )
    assert root not in error.message
