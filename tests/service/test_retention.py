"""Retention: files expire (expires_after, output_expires_after), parts go once the output is final,
`bulkgen gc` removes the rest; cursors survive deletion; /metrics reads do not grow with stored batches."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.request import urlopen

import openai
import pytest

from bulkgen.batch import lifecycle, totals
from bulkgen.batch.batchrecord import RequestCounts, new_batch_record
from bulkgen.batch.records import FileRepo
from bulkgen.store import LocalStore
from tests.service.api_only import ApiOnly
from tests.store.test_listing import CountingStore
from tests.support.service import completion_row, read_lines, upload, wait_done, write_jsonl

ROOT = Path(__file__).resolve().parents[2]
DAY = 24 * 3600


@pytest.fixture
def api(tmp_path):
    server = ApiOnly(LocalStore(tmp_path / "storage", fsync=False))
    yield server
    server.stop()


def _age(store, file_id: str, seconds: float) -> None:
    """Move a file's expires_at `seconds` into the past, as time would."""
    key = FileRepo.meta_key(file_id)
    record = json.loads(store.read_bytes(key))
    record["expires_at"] = int(time.time() - seconds)
    store.write_bytes(key, json.dumps(record).encode())


@pytest.mark.parametrize("seconds", [-100, 0, 3599, 30 * DAY + 1, "soon", 1.5])
def test_expires_after_out_of_bounds_is_400_naming_the_field(api, seconds):
    with pytest.raises(openai.BadRequestError) as err:
        api.client().files.create(
            file=("a.jsonl", b"{}\n"),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": seconds},
        )
    assert err.value.body["param"] == "expires_after[seconds]"
    assert "from 3600 (1 hour) to 2592000 (30 days)" in err.value.body["message"]


def test_expires_after_anchor_must_be_created_at(api):
    with pytest.raises(openai.BadRequestError, match=r"expires_after\[anchor\] must be 'created_at'"):
        api.client().files.create(
            file=("a.jsonl", b"{}\n"),
            purpose="batch",
            expires_after={"anchor": "last_active_at", "seconds": 3600},
        )


def test_expired_file_is_404_and_unlisted_before_gc(api):
    client = api.client()
    forever = client.files.create(file=("keep.jsonl", b"{}\n"), purpose="batch")
    assert forever.expires_at is None
    brief = client.files.create(
        file=("brief.jsonl", b"{}\n"),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert brief.expires_at == brief.created_at + 3600
    assert client.files.retrieve(brief.id).id == brief.id
    _age(api.svc.store, brief.id, 1)
    never = "file-" + "0" * 24
    for call in (client.files.retrieve, client.files.content):  # answered as an id that never existed
        with pytest.raises(openai.NotFoundError) as gone:
            call(brief.id)
        with pytest.raises(openai.NotFoundError) as unknown:
            call(never)
        assert gone.value.response.text == unknown.value.response.text.replace(never, brief.id)
        assert (
            "expire" not in gone.value.response.text and str(brief.expires_at) not in gone.value.response.text
        )
    for order in ("asc", "desc"):
        assert [f.id for f in client.files.list(order=order)] == [forever.id]
    assert api.svc.store.exists(FileRepo.data_key(brief.id))  # the bytes stay until gc


def test_sdk_list_and_delete_loop_sees_every_file(api):
    """The auto-pager asks for `after=<last id>`, which the loop has just deleted."""
    client = api.client()
    ids = {client.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch").id for i in range(127)}
    seen = []
    for f in client.files.list(limit=10):
        client.files.delete(f.id)
        seen.append(f.id)
    assert sorted(seen) == sorted(ids)


def _ended_batches(store, count: int) -> None:
    svc_store = store
    for _ in range(count):
        record = new_batch_record("file-x", "/v1/completions", "24h", None)
        for status in ("in_progress", "finalizing", "completed"):
            lifecycle.transition(record, status)
        record.request_counts = RequestCounts(total=2, completed=2)
        record.usage.update(input_tokens=3, output_tokens=5, total_tokens=8)
        svc_store.write_bytes(f"batches/{record.id}.json", json.dumps(record.to_json()).encode())
        totals.add_ended(svc_store, record)


def _scrape(root: str) -> dict[str, float]:
    text = urlopen(f"{root}/metrics").read().decode()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_metrics_reads_do_not_grow_with_stored_batches(tmp_path):
    store = CountingStore(tmp_path / "storage")
    server = ApiOnly(store)
    server.app.state.metrics_cache.max_age_s = 0  # every scrape reads storage (else once per 5 s)
    for _ in range(2):  # two live batches: read from the active index, one record each
        record = lifecycle.transition(
            new_batch_record("file-x", "/v1/completions", "24h", None), "in_progress"
        )
        record.request_counts = RequestCounts(total=10, completed=4)
        server.svc.batches.create(record)
        store.write_bytes(f"active/{record.id}", b"")
    try:
        costs = []
        for count in (10, 1000):
            _ended_batches(store, count - (10 if costs else 0))
            store.reads = store.listings = 0
            values = _scrape(server.root)
            costs.append((store.reads, store.listings))
            assert values['bulkgen_batches{status="completed"}'] == count
            assert values['bulkgen_batches{status="in_progress"}'] == 2
            assert values['bulkgen_requests{outcome="completed"}'] == 2 * count + 8
            assert values['bulkgen_tokens{kind="output"}'] == 5 * count
            assert values["bulkgen_queue_requests"] == 12
        assert costs == [(3, 1), (3, 1)]  # the totals, the active index and its two records
    finally:
        server.stop()


def test_output_expiry_parts_deleted_and_gc(service, client, tmp_path):
    rows = [completion_row(f"r{i}", f"item {i}", max_tokens=4) for i in range(20)]
    batch = client.batches.create(
        input_file_id=upload(client, write_jsonl(tmp_path / "r.jsonl", rows)).id,
        endpoint="/v1/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    batch = wait_done(client, batch.id)
    assert batch.status == "completed"
    output = client.files.retrieve(batch.output_file_id)
    assert output.expires_at == output.created_at + 7200
    assert len(read_lines(client, batch.output_file_id)) == 20
    store = service.svc.store
    assert list(store.list(f"parts/{batch.id}/lines-")) == []  # final output: the parts are gone
    assert store.exists(f"reports/{batch.id}/metrics-state.json")  # the charts' data stays with the report
    assert len(list(store.list(f"parts/{batch.id}/runner-"))) == 1

    # what a finalize that died half way, or a runner that stopped, leaves behind
    store.write_bytes(f"parts/{batch.id}/lines-000000001-000000002.jsonl", b"{}\n")
    store.write_bytes("parts/batch_gone/lines-000000001-000000002.jsonl", b"{}\n")
    store.write_bytes(f"leases/{batch.id}.json", json.dumps({"owner": "x", "expires_at": 0}).encode())
    _age(store, batch.output_file_id, 1)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    gc = [sys.executable, "-m", "bulkgen", "gc", "--storage", store.url]
    dry = subprocess.run([*gc, "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[0].startswith(f"expired files: would remove 1 ({batch.output_file_id})")
    assert lines[1] == "orphaned parts: would remove 2 objects of 2 ended batches"
    assert lines[2].startswith("stale leases: would remove ") and batch.id in lines[2]
    assert store.exists(FileRepo.data_key(batch.output_file_id))
    done = subprocess.run(gc, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1] == "orphaned parts: removed 2 objects of 2 ended batches"
    for key in (
        FileRepo.data_key(batch.output_file_id),
        FileRepo.meta_key(batch.output_file_id),
        f"leases/{batch.id}.json",
        "parts/batch_gone/lines-000000001-000000002.jsonl",
    ):
        assert not store.exists(key), key
    assert client.files.retrieve(batch.input_file_id).id == batch.input_file_id  # not expired: kept
    assert len(list(store.list(f"parts/{batch.id}/runner-"))) == 1


def test_output_expires_after_is_checked_at_create(client, tmp_path):
    file_id = upload(client, write_jsonl(tmp_path / "x.jsonl", [completion_row("a", "x")])).id
    with pytest.raises(openai.BadRequestError, match=r"output_expires_after\[seconds\]"):
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 10},
        )


def test_gc_covers_every_tenant(tmp_path):
    from bulkgen.batch.service import BatchService
    from bulkgen.runtime.gc import collect
    from bulkgen.settings import Settings

    root = LocalStore(tmp_path / "storage", fsync=False)
    root.create()
    svc = BatchService(Settings(storage=root.url), store=root)
    ids = {}
    for tenant in ("default", "acme"):
        one = svc.for_tenant(tenant)
        ids[tenant] = one.files.create(io.BytesIO(b"{}\n"), "x.jsonl", "batch", 3600)["id"]
        _age(one.store, ids[tenant], 1)
    assert root.exists(f"tenants/acme/{FileRepo.data_key(ids['acme'])}")
    assert sorted(collect(svc, dry_run=True).expired_files) == sorted(ids.values())
    collect(svc)
    assert not root.exists(FileRepo.data_key(ids["default"]))
    assert not root.exists(f"tenants/acme/{FileRepo.data_key(ids['acme'])}")
    assert collect(svc).expired_files == []
