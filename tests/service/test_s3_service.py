"""The whole service with its storage on a real S3 endpoint (moto's server over HTTP)."""

from __future__ import annotations

import json

import boto3

from tests.support.service import SAMPLES, Service, random_model, read_lines, settings_for, upload, wait_done


def test_batch_round_trip_on_s3(s3_bucket_url, s3_server):
    service = Service(settings_for(s3_bucket_url, endpoint_url=s3_server))
    try:
        client = service.client()
        batch = client.batches.create(
            input_file_id=upload(client, SAMPLES / "completions.jsonl").id,
            endpoint="/v1/completions",
            completion_window="24h",
        )
        batch = wait_done(client, batch.id)
        assert batch.status == "completed"
        assert len(read_lines(client, batch.output_file_id)) == 10
    finally:
        service.stop()
    bucket = s3_bucket_url.removeprefix("s3://").split("/")[0]
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]
    assert f"prefix/batches/{batch.id}.json" in keys
    assert not any(k.startswith(f"prefix/parts/{batch.id}/lines-") for k in keys)  # deleted once final
    assert any(k.startswith(f"prefix/parts/{batch.id}/runner-") for k in keys)
    assert f"prefix/reports/{batch.id}/report.png" in keys


def test_model_loaded_from_object_storage(s3_bucket_url, s3_server):
    """`--model NAME=s3://…`: the driver and every worker copy it from the bucket, never from a hub."""
    bucket, prefix = s3_bucket_url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    for path in random_model().iterdir():
        s3.upload_file(str(path), bucket, f"{prefix}/models/tiny/{path.name}")
    settings = settings_for(s3_bucket_url, endpoint_url=s3_server)
    settings.models = {"tiny-from-s3": f"s3://{bucket}/{prefix}/models/tiny"}
    service = Service(settings)
    try:
        client = service.client()
        assert [m.id for m in client.models.list()] == ["tiny-from-s3"]
        row = {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny-from-s3", "prompt": "hello", "max_tokens": 3},
        }
        batch = client.batches.create(
            input_file_id=client.files.create(file=("r.jsonl", json.dumps(row).encode()), purpose="batch").id,
            endpoint="/v1/completions",
            completion_window="24h",
        )
        batch = wait_done(client, batch.id)
        assert batch.status == "completed", batch.errors
        (line,) = read_lines(client, batch.output_file_id)
        assert line["response"]["body"]["model"] == "tiny-from-s3"
        assert line["response"]["body"]["usage"]["completion_tokens"] == 3
    finally:
        service.stop()
