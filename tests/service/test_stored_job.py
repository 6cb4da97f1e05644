"""jobs/batch_job.py: a JSONL file dropped into the bucket runs as a batch, results written beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from tests.support.service import SAMPLES, random_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_batch_job_runs_a_dropped_file_on_s3(s3_bucket_url, s3_server, tmp_path):
    bucket, prefix = s3_bucket_url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    s3.upload_file(str(SAMPLES / "completions.jsonl"), bucket, f"{prefix}/inbox/day1.jsonl")
    s3.put_object(Bucket=bucket, Key=f"{prefix}/inbox/broken.jsonl", Body=b"not json\n")
    model = f"bulkgen-tiny={random_model()}"
    base = [sys.executable, str(ROOT / "jobs" / "batch_job.py"), "--storage", s3_bucket_url, "--model", model]

    ok = subprocess.run(
        [*base, "--input", "inbox/day1.jsonl"], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    body = s3.get_object(Bucket=bucket, Key=f"{prefix}/outbox/day1.output.jsonl")["Body"].read().decode()
    assert len(body.splitlines()) == 10
    assert json.loads(body.splitlines()[0])["custom_id"] == "completion-000"

    bad = subprocess.run(
        [*base, "--input", "inbox/broken.jsonl"], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert bad.returncode == 1 and "inbox/broken.jsonl:1" in bad.stderr and "Traceback" not in bad.stderr
