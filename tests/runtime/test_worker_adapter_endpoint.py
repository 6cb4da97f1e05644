"""Workers are named and shared: one worker may serve several services, each with its own S3 endpoint
(--endpoint-url). A batch's s3:// adapter is fetched from the endpoint of the batch's own service
(QueuedBatch.endpoint_url), not from the endpoint of whichever service had the worker load its model last
(EngineWorker as plain Python, no Ray; the adapter in moto's bucket over HTTP, and no AWS_ENDPOINT_URL
set, so the default AWS endpoint cannot stand in for it)."""

from __future__ import annotations

import uuid

from bulkgen.engine.config import EngineConfig
from bulkgen.lab.tiny_lora import save_random_adapter
from bulkgen.runtime.worker import EngineWorker
from bulkgen.store import LocalStore
from tests.runtime.test_worker import _drain, _lines
from tests.runtime.test_worker_refusals import _batch
from tests.support.service import MODEL, completion_row, random_model


def test_an_s3_adapter_comes_from_its_batchs_service_endpoint_not_the_last_loads(
    tmp_path, s3_server, monkeypatch
):
    import boto3

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    bucket = f"lora-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    s3.create_bucket(Bucket=bucket)
    adapter = save_random_adapter(random_model(), tmp_path / "terse", 3, 4, 8, ("q_proj",), base_name=MODEL)
    for path in adapter.iterdir():
        s3.upload_file(str(path), bucket, f"adapters/terse/{path.name}")
    (tmp_path / "store").mkdir()
    store = LocalStore(tmp_path / "store")
    worker = EngineWorker(0, EngineConfig(max_num_seqs=8))
    worker.load(MODEL, str(random_model()))  # by a service on a local folder, without an endpoint

    rows = [completion_row(f"r{i}", f"hello {i}", max_tokens=2, model="terse") for i in range(2)]
    job, ranges = _batch(
        store, "b1", rows, {"terse": f"s3://{bucket}/adapters/terse/"}, endpoint_url=s3_server
    )
    worker.assign(job, ranges)
    assert [o.error for o in _drain(worker, len(ranges))] == [None] * len(ranges)
    lines = _lines(store, "b1")
    assert sorted(lines) == [1, 2] and all(entry["ok"] for entry in lines.values()), lines
