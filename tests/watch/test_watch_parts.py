"""The watcher's parts, in this process and without workers: cron, job files, defaults, listings, SQS."""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest

from bulkgen.batch.outputlines import not_run_line, refused_line, success_line
from bulkgen.batch.requests import CHAT, COMPLETIONS, Fill, ParsedRequest, RequestLine
from bulkgen.batch.resultfiles import parquet_row
from bulkgen.batch.service import BatchService
from bulkgen.batch.validate import Validator, validate_stream
from bulkgen.settings import Settings
from bulkgen.store import LocalStore, layout, open_store
from bulkgen.watch.cron import Cron, CronError
from bulkgen.watch.job import Job, JobError
from bulkgen.watch.sources import SqsSource
from bulkgen.watch.watcher import Watcher
from tests.support.clock import FakeClock
from tests.support.watch import ROOT

UTC = dt.timezone.utc


def test_cron_next_after():
    weekdays = Cron("*/15 9-17 * * 1-5")
    friday_evening = dt.datetime(2026, 11, 27, 17, 50, tzinfo=UTC)
    assert weekdays.next_after(friday_evening) == dt.datetime(2026, 11, 30, 9, 0, tzinfo=UTC)
    assert weekdays.next_after(dt.datetime(2026, 11, 30, 9, 0, tzinfo=UTC)).minute == 15
    assert Cron("0 0 1 1 *").next_after(friday_evening) == dt.datetime(2027, 1, 1, tzinfo=UTC)
    # both day fields restricted: the 13th OR a Friday, as cron does
    either = Cron("0 12 13 * 5")
    assert either.next_after(dt.datetime(2026, 11, 28, tzinfo=UTC)) == dt.datetime(
        2026, 12, 4, 12, tzinfo=UTC
    )
    assert Cron("30 4 * * 7").next_after(friday_evening) == dt.datetime(2026, 11, 29, 4, 30, tzinfo=UTC)
    for bad in ("* * * *", "61 * * * *", "*/0 * * * *", "a * * * *", "0 0 31 2 *"):
        with pytest.raises(CronError):
            Cron(bad).next_after(friday_evening)


def test_example_jobs_load():
    summarize = Job.load(ROOT / "jobs" / "summarize-inbox.yaml")
    assert summarize.body_defaults() == {"model": "bulkgen-tiny", "temperature": 0.7, "max_tokens": 64}
    assert summarize.poll_interval() == 10 and summarize.output_format == "jsonl"
    labels = Job.load(ROOT / "jobs" / "labels-parquet.yaml")
    assert labels.output_format == "parquet" and labels.poll_interval() is None and labels.schedule
    labels.override(interval=2.0)  # the command line replaces the job's schedule
    assert labels.check().poll_interval() == 2.0 and labels.schedule is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("input: a\noutput: b\ncolour: red\n", "unknown field(s) colour"),
        (
            "input: a\noutput: b\ndefaults: {temperature: 9}\n",
            "body.temperature must be a number between 0 and 2",
        ),
        ("input: a\noutput: b\ndefaults: {stream: true}\n", "streaming is not supported"),
        ("input: a\noutput: b\noutput_format: csv\n", "output_format must be one of jsonl, parquet"),
        ("input: a\noutput: b\nschedule: '* * *'\n", "must have 5 fields"),
        ("input: a\noutput: b\ninterval: 5\nschedule: '* * * * *'\n", "interval or schedule, not both"),
        ("output: b\n", "input (a folder or s3://bucket/prefix/) is required"),
        ("- a list\n", "a job is a YAML mapping"),
        (
            "input: a\noutput: b\ntensor_parallel: 0\n",
            "tensor_parallel must be a positive whole number of ranks",
        ),
        (
            "input: a\noutput: b\ntensor_parallel: {big: 0}\n",
            "tensor_parallel must be a positive whole number of ranks, or a mapping {NAME: N}",
        ),
    ],
)
def test_bad_jobs_say_what_and_where(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(JobError) as err:
        Job.load(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_fill_sets_only_what_a_line_lacks_in_its_one_parse():
    """The stored file holds each line as filled; a line that sets a field keeps it, and a line the
    validator refuses is stored as written."""
    fill = Fill({"model": "m", "temperature": 0.7, "max_tokens": 64}, CHAT)
    bare = b'{"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}]}}'
    line = RequestLine.read(bare, 1, CHAT, fill)
    filled = json.loads(line.stored)
    assert (
        filled["url"] == CHAT and filled["body"]["temperature"] == 0.7 and filled["body"]["max_tokens"] == 64
    )
    request = line.request()
    assert request.model == "m" and request.sampling["max_tokens"] == 64
    own = (
        b'{"custom_id": "b", "url": "/v1/completions", "body": {"model": "x", "prompt": "p", "temperature": 0, '
        b'"max_completion_tokens": 5}}'
    )
    kept = RequestLine.read(own, 2, COMPLETIONS, fill)
    assert kept.url == COMPLETIONS and kept.model == "x" and kept.body["temperature"] == 0
    assert "max_tokens" not in kept.body  # max_completion_tokens already says it
    lines = [bare, b"not json", b"[1, 2]", b'{"custom_id": "c", "body": "text"}', b""]
    stored = io.BytesIO()
    result = validate_stream(
        io.BytesIO(b"\n".join(lines)), Validator(CHAT, ["m"], 10, fill=fill), sink=stored
    )
    assert stored.getvalue().split(b"\n") == [line.stored, *lines[1:-1], b""]
    assert [(e["line"], e["code"]) for e in result.errors] == [
        (2, "invalid_json_line"),
        (3, "invalid_json_line"),
        (4, "invalid_body"),
    ]


def test_local_list_objects_version_changes_with_the_file(tmp_path):
    store = LocalStore(tmp_path)
    store.write_bytes("inbox/a.jsonl", b"one\n")
    store.write_bytes("inbox/b/c.jsonl", b"two\n")
    first = {info.key: info for info in store.list_objects("inbox/")}
    assert sorted(first) == ["inbox/a.jsonl", "inbox/b/c.jsonl"] and first["inbox/a.jsonl"].size == 4
    time.sleep(0.01)  # inherent: the version is the file's mtime, which the kernel moves on once per tick
    store.write_bytes("inbox/a.jsonl", b"one\n")  # same bytes, written again: a new version all the same
    assert store.stat("inbox/a.jsonl").etag != first["inbox/a.jsonl"].etag
    assert store.stat("inbox/b/c.jsonl") == first["inbox/b/c.jsonl"]


def test_scan_pages_past_1000_objects_and_skips_finished_ones(s3_bucket_url, s3_server):
    bucket = s3_bucket_url.removeprefix("s3://").split("/", 1)[0]
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda i: s3.put_object(Bucket=bucket, Key=f"inbox/n{i:04d}.txt", Body=b"x"), range(1001)
            )
        )
    inbox = open_store(f"s3://{bucket}/inbox", endpoint_url=s3_server)
    listed = list(inbox.list_objects(""))
    assert len(listed) == 1001 and listed[-1].key == "n1000.txt"
    assert listed[500].etag == s3.head_object(Bucket=bucket, Key="inbox/n0500.txt")["ETag"]

    svc = BatchService(
        Settings(storage=f"s3://{bucket}/store", endpoint_url=s3_server, models={"m": "unused"})
    )
    spec = Job(input=f"s3://{bucket}/inbox/", output=f"s3://{bucket}/outbox/", interval=60)
    watcher = Watcher(svc, spec, endpoint_url=s3_server)
    with ThreadPoolExecutor(8) as pool:  # as if an earlier watcher had finished all of them
        done = [layout.watch_done(watcher.claims.name(info)) for info in listed]
        list(pool.map(lambda key: svc.store.write_bytes(key, b""), done))
    s3.put_object(Bucket=bucket, Key="inbox/zz-new.txt", Body=b"late")
    s3.put_object(Bucket=bucket, Key="inbox/n0001.txt", Body=b"changed")  # a new ETag: processed again
    s3.put_object(Bucket=bucket, Key="inbox/.upload-in-progress.jsonl", Body=b"{")

    assert watcher.scan() == 2
    report = json.loads(s3.get_object(Bucket=bucket, Key="outbox/zz-new.txt.report.json")["Body"].read())
    assert (
        "only *.jsonl objects run as batches" in report["reason"] and report["source"]["key"] == "zz-new.txt"
    )
    assert "changed" not in json.dumps(report)
    assert s3.head_object(Bucket=bucket, Key="outbox/n0001.txt.report.json")
    assert watcher.scan() == 0 and not watcher.pending and watcher.manager is None  # no workers were needed


def test_sqs_source_reads_s3_events_with_encoded_keys(s3_bucket_url, s3_server):
    bucket = s3_bucket_url.removeprefix("s3://").split("/", 1)[0]
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    sqs = boto3.client("sqs", endpoint_url=s3_server, region_name="us-east-1")
    queue_url = sqs.create_queue(QueueName=f"q-{bucket}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    s3.put_bucket_notification_configuration(
        Bucket=bucket,
        NotificationConfiguration={
            "QueueConfigurations": [{"QueueArn": arn, "Events": ["s3:ObjectCreated:*"]}]
        },
    )
    s3.put_object(Bucket=bucket, Key="inbox/day 1+2.jsonl", Body=b"{}\n")
    s3.put_object(Bucket=bucket, Key="elsewhere/x.jsonl", Body=b"{}\n")

    source = SqsSource(queue_url, bucket, "inbox", endpoint_url=s3_server)
    source.start()
    try:
        got = []
        deadline = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:
            got += source.messages(timeout=1)
    finally:
        source.stop()
    assert [m.test for m in got] == [True, False, False]
    assert [m.keys for m in got[1:]] == [["day 1+2.jsonl"], []]  # the other prefix is not ours
    for message in got:
        source.delete(message)
    attrs = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["All"])["Attributes"]
    assert (
        attrs["ApproximateNumberOfMessages"] == "0" and attrs["ApproximateNumberOfMessagesNotVisible"] == "0"
    )


def test_parquet_rows_from_every_line_shape():
    request = ParsedRequest("ok", 1, "m", CHAT)
    result = {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "completions": [{"index": 0, "text": "hi", "finish_reason": "length"}],
    }
    assert parquet_row(success_line(request, result, "m")) == {
        "custom_id": "ok",
        "status": "completed",
        "text": "hi",
        "finish_reason": "length",
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "error_code": None,
        "error_message": None,
    }
    refused = parquet_row(refused_line("long", "too long for the context", "context_length_exceeded"))
    assert refused["status"] == "failed" and refused["error_code"] == "context_length_exceeded"
    assert refused["error_message"] == "too long for the context" and refused["text"] is None
    not_run = parquet_row(not_run_line("late", "batch_expired"))
    assert not_run["status"] == "failed" and not_run["error_code"] == "batch_expired"


def test_on_batch_end_is_called_once_with_the_final_record(tmp_path):
    """A file refused by validation ends at once, so this needs no workers."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "bad.jsonl").write_text(json.dumps({"custom_id": "a", "url": CHAT, "body": "m"}) + "\n")
    ended = []
    svc = BatchService(Settings(storage=str(tmp_path / "store"), models={"m": "unused"}))
    watcher = Watcher(svc, Job(input=str(inbox), output=str(tmp_path / "outbox")), on_batch_end=ended.append)
    assert watcher.scan() == 1
    watcher.check_pending()
    watcher.check_pending()
    assert watcher.scan() == 0 and [r["status"] for r in ended] == ["failed"] and "x_bulkgen" not in ended[0]
    assert ended[0]["errors"]["data"][0]["param"] == "body"  # a line without a body object: the file's error
    assert svc.batches.get(ended[0]["id"]).metadata["watch_input"] == f"{inbox}/bad.jsonl"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sqs-queue-url", "http://127.0.0.1:1/q"], "needs an s3:// input"),
        (["--output", "{inbox}/results"], "is inside the input"),
        (["--schedule", "every day"], "must have 5 fields"),
        (["--webhook", "http://127.0.0.1:1/hook"], "--webhook needs --webhook-secret"),
        (["--tenant", "../x"], "tenant name '../x' is not valid"),
    ],
)
def test_watch_refuses_bad_options_in_one_line(tmp_path, args, message):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    base = ["--input", str(inbox), "--output", str(tmp_path / "out"), "--storage", str(tmp_path / "store")]
    run = subprocess.run(
        [sys.executable, "-m", "bulkgen", "watch", *base, *[a.format(inbox=inbox) for a in args]],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr


def test_watch_once_reports_and_exits(tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "photo.png").write_bytes(b"\x89PNG")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bulkgen",
            "watch",
            "--once",
            "--input",
            str(inbox),
            "--output",
            str(tmp_path / "out"),
            "--storage",
            str(tmp_path / "store"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "photo.png: not run: not a .jsonl object" in run.stderr
    assert json.loads((tmp_path / "out" / "photo.png.report.json").read_text())["status"] == "not_run"


def test_a_claim_whose_watcher_died_before_recording_its_batch_is_resumed_not_run_twice(tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "bad.jsonl").write_text(json.dumps({"custom_id": "a", "url": CHAT, "body": "m"}) + "\n")
    svc = BatchService(Settings(storage=str(tmp_path / "store"), models={"m": "unused"}))
    spec = Job(input=str(inbox), output=str(tmp_path / "outbox"), claim_ttl=60)
    clock = FakeClock()
    dead = Watcher(svc, spec, owner="dead")
    dead.claims.clock = clock
    claim = dead.claims.take(dead.inbox.stat("bad.jsonl"))
    dead._upload(claim)
    record = svc.create_batch(claim.file_id, CHAT, "24h", None)  # ... and it died before writing the claim
    assert dead.claims.take(dead.inbox.stat("bad.jsonl")) is not None  # its own claim, while it is alive
    alive = Watcher(svc, spec, owner="alive")
    alive.claims.clock = clock
    assert alive.scan() == 1 and not alive.pending  # the dead watcher's claim has not lapsed yet
    clock.advance(61)
    assert alive.scan() == 1 and [c.batch_id for c in alive.pending.values()] == [record.id]
    alive.check_pending()
    assert list(svc.batches.ids()) == [record.id] and not alive.pending
    assert json.loads((tmp_path / "outbox" / "bad.summary.json").read_text())["batch"]["id"] == record.id
