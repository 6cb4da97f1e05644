"""`bulkgen watch` on S3 (moto over HTTP): S3 events through SQS, two watchers at once, Parquet results."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor

import boto3
import pyarrow.parquet as pq
import pytest

from tests.support.watch import ROOT, rows_jsonl, wait_until


def exists(s3, bucket: str, key: str) -> bool:
    return s3.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount", 0) > 0


def read_json(s3, bucket: str, key: str) -> dict:
    return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def all_json(s3, bucket: str, prefix: str) -> list[dict]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [read_json(s3, bucket, item["Key"]) for page in pages for item in page.get("Contents", [])]


@pytest.mark.slow
def test_sqs_events_two_watchers_and_parquet(s3_bucket_url, s3_server, tmp_path, watch_process):
    bucket = s3_bucket_url.removeprefix("s3://").split("/", 1)[0]
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    sqs = boto3.client("sqs", endpoint_url=s3_server, region_name="us-east-1")
    queue_url = sqs.create_queue(QueueName=f"events-{bucket}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    s3.put_bucket_notification_configuration(
        Bucket=bucket,
        NotificationConfiguration={  # sends s3:TestEvent
            "QueueConfigurations": [{"QueueArn": arn, "Events": ["s3:ObjectCreated:*"]}]
        },
    )
    common = (
        "--job",
        str(ROOT / "jobs" / "labels-parquet.yaml"),
        "--input",
        f"s3://{bucket}/inbox/",
        "--output",
        f"s3://{bucket}/outbox/",
        "--storage",
        f"s3://{bucket}/store",
        "--claim-ttl",
        "20",
    )
    # events only (the backstop poll is far off), so what it runs came through the queue
    by_event = watch_process(tmp_path / "sqs.log", *common, "--sqs-queue-url", queue_url, "--interval", "600")
    by_event.wait_log("scan: 0 objects")

    # lines without url, model or max_tokens: the job fills them in; a line's own max_tokens wins
    rows = [
        json.loads(line) for line in (ROOT / "samples" / "watch" / "labels.jsonl").read_text().splitlines()
    ]
    rows.append({"custom_id": "own", "body": {"prompt": "Short one:", "max_tokens": 3}})
    s3.put_object(Bucket=bucket, Key="inbox/day 1+2.jsonl", Body=rows_jsonl(rows))
    wait_until(lambda: exists(s3, bucket, "outbox/day 1+2.summary.json"), 180, "day 1+2 results", by_event)

    table = pq.read_table(
        io.BytesIO(s3.get_object(Bucket=bucket, Key="outbox/day 1+2.output.parquet")["Body"].read())
    )
    assert table.column_names == [
        "custom_id",
        "status",
        "text",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "error_code",
        "error_message",
    ]
    got = table.to_pylist()
    assert [r["custom_id"] for r in got] == ["label-0", "label-1", "label-2", "own"]
    assert {r["status"] for r in got} == {"completed"} and all(
        r["text"] and r["prompt_tokens"] > 0 for r in got
    )
    assert [r["completion_tokens"] for r in got] == [8, 8, 8, 3] and got[3]["finish_reason"] == "length"
    assert read_json(s3, bucket, "outbox/day 1+2.summary.json")["written"] == ["day 1+2.output.parquet"]
    assert not exists(s3, bucket, "outbox/day 1+2.output.jsonl")
    assert "s3:TestEvent received and ignored" in by_event.text()
    [claim] = all_json(s3, bucket, "store/watch/claims/")
    assert claim["key"] == "day 1+2.jsonl" and f"-{by_event.pid}-" in claim["owner"]

    def queue_empty():
        attrs = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["All"])["Attributes"]
        return attrs["ApproximateNumberOfMessages"] == attrs["ApproximateNumberOfMessagesNotVisible"] == "0"

    wait_until(
        queue_empty, 30, "the queue emptied (each message deleted once its batch was durable)", by_event
    )

    # a second watcher, polling every second, beside the first: every object runs once, by one of them
    by_poll = watch_process(tmp_path / "poll.log", *common, "--interval", "1")
    by_poll.wait_log("scan: 1 objects")
    names = [f"inbox/drop-{i}.jsonl" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda key: s3.put_object(Bucket=bucket, Key=key, Body=rows_jsonl(rows[:2])), names))
    wait_until(
        lambda: all(exists(s3, bucket, f"outbox/drop-{i}.summary.json") for i in range(6)),
        240,
        "results of the six dropped files",
        by_event,
        by_poll,
    )

    batches = all_json(s3, bucket, "store/batches/")
    sources = sorted(b["metadata"]["watch_input"].rsplit("/", 1)[-1] for b in batches)
    assert sources == [
        "day 1+2.jsonl",
        *[n.removeprefix("inbox/") for n in names],
    ]  # each object exactly once
    assert all(b["status"] == "completed" for b in batches)
    claims = all_json(s3, bucket, "store/watch/claims/")
    assert len(claims) == 7 and {c["state"] for c in claims} == {"done"}
    owners = {c["owner"].split("-")[-2] for c in claims}
    print(f"objects per watcher: {[sum(c['owner'].split('-')[-2] == o for c in claims) for o in owners]}")
    wait_until(queue_empty, 30, "the queue emptied", by_event)
    assert by_event.alive() and by_poll.alive()
