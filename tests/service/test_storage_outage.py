"""Storage faults under a running service: the API answers 503 in OpenAI's shape while storage is down,
injected S3 faults during a batch lose and duplicate nothing, and a lasting outage stops the runner
(the batch stays active) until storage is back, when the batch resumes from its parts."""

from __future__ import annotations

import json
from urllib.request import urlopen

import boto3
import openai
import pytest

from bulkgen.store import open_store
from tests.service.api_only import ApiOnly
from tests.support.held_engine import HOLD
from tests.support.s3 import FAST_RETRY
from tests.support.service import (
    Service,
    completion_row,
    read_lines,
    settings_for,
    upload,
    wait_done,
    write_jsonl,
)
from tests.support.wait import wait_until


def _health(root: str) -> dict:
    with urlopen(f"{root}/health") as response:
        assert response.status == 200
        return json.loads(response.read())


def test_api_answers_503_while_storage_is_down(s3_bucket_url, flaky_proxy):
    api = ApiOnly(open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, retry_attempts=2, **FAST_RETRY))
    api.app.state.storage_probe.max_age_s = 0
    try:
        client = api.client()
        uploaded = client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
        assert _health(api.root)["storage"] == "ok"
        flaky_proxy.down = "drop"
        for call in (
            lambda: client.files.list(),
            lambda: client.files.retrieve(uploaded.id),
            lambda: client.batches.list(),
            lambda: client.files.create(file=("b.jsonl", b"{}\n"), purpose="batch"),
        ):
            with pytest.raises(openai.InternalServerError) as err:
                call()
            assert err.value.status_code == 503
            assert (
                err.value.body["code"] == "storage_unavailable" and err.value.body["type"] == "server_error"
            )
            assert err.value.body["message"] == "storage unavailable; try again later"
            assert s3_bucket_url.split("/")[2] not in err.value.response.text  # the bucket is not named
        health = _health(api.root)
        assert health["status"] == "degraded" and health["storage"].startswith("unavailable: unreachable")
        flaky_proxy.down = None
        assert _health(api.root)["status"] == "ok"
        assert client.files.retrieve(uploaded.id).id == uploaded.id
    finally:
        api.stop()


def _rows(n: int, max_tokens: int) -> list[dict]:
    return [completion_row(f"c{i}", f"item {i} " * (1 + i % 4), max_tokens=max_tokens) for i in range(n)]


def _assert_exactly_once(client, batch, rows) -> None:
    out, err = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    assert err == []
    assert [line["custom_id"] for line in out] == [r["custom_id"] for r in rows]  # each once, in input order
    assert batch.request_counts.completed == len(rows)


def test_s3_faults_during_a_batch_lose_and_duplicate_nothing(s3_bucket_url, flaky_proxy, tmp_path):
    service = Service(settings_for(s3_bucket_url, endpoint_url=flaky_proxy.url))
    try:
        client = service.client()
        rows = _rows(96, 8)
        file_id = upload(client, write_jsonl(tmp_path / "f.jsonl", rows)).id
        flaky_proxy.rate = 0.15  # 5xx, SlowDown, dropped connections and lost answers, from here on
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        batch = wait_done(client, batch.id, timeout=300)
        flaky_proxy.rate = 0
        assert batch.status == "completed", batch.errors
        _assert_exactly_once(client, batch, rows)
        injected = [s for _, _, s in flaky_proxy.log if s in (0, 500, 503)]
        assert len(injected) >= 10, len(injected)
    finally:
        service.stop()


def test_lasting_outage_stops_the_runner_and_the_batch_resumes(
    s3_bucket_url, s3_server, flaky_proxy, tmp_path, engine_gate
):
    service = Service(settings_for(s3_bucket_url, endpoint_url=flaky_proxy.url, storage_outage_timeout_s=3))
    try:
        client = service.client()
        held = [completion_row(f"h{i}", f"{HOLD} item {i}", max_tokens=64) for i in range(16)]
        rows = held + _rows(48, 8)  # the held range keeps the batch running when storage goes down
        file_id = upload(client, write_jsonl(tmp_path / "o.jsonl", rows)).id
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        wait_until(
            lambda: client.batches.retrieve(batch.id).request_counts.completed, 120, "the batch to start"
        )
        engine_gate.wait_held()
        flaky_proxy.down = "drop"
        wait_until(
            lambda: service.manager.runner_of(batch.id) is None,
            120,
            "the runner to stop after the outage timeout",
            interval=0.1,
        )
        bucket, prefix = s3_bucket_url.removeprefix("s3://").split("/", 1)
        s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
        stored = json.loads(
            s3.get_object(Bucket=bucket, Key=f"{prefix}/batches/{batch.id}.json")["Body"].read()
        )
        assert stored["status"] in ("in_progress", "finalizing")  # left active: nothing written while down
        s3.head_object(Bucket=bucket, Key=f"{prefix}/active/{batch.id}")
        flaky_proxy.down = None
        engine_gate.open()
        batch = wait_done(client, batch.id, timeout=300)
        assert batch.status == "completed", batch.errors
        _assert_exactly_once(client, batch, rows)
    finally:
        flaky_proxy.down = None
        service.stop()
