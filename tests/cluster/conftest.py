"""The network-namespace cluster of the scenarios (tests/cluster/rig.py) and what they do with it.

`cluster` brings up the head (with the S3 server) and nodes a and b once for the scenarios' module, runs
`bulkgen serve` on the head, and always tears everything down by the PIDs it started, on failure and on
KeyboardInterrupt too (pytest's teardown, and atexit as a second net). The test's clients (openai,
boto3) run in a thread inside the client namespace bgt-cli, a host that is not a Ray node.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from tests.cluster.rig import (
    API_PORT,
    GCS,
    HEAD_IP,
    S3_URL,
    InNamespace,
    Rig,
    RigUnavailable,
    check_available,
)
from tests.support.wait import wait_until

BUCKET = "bgt-store"
STORAGE = f"s3://{BUCKET}/bulkgen"
API = f"http://{HEAD_IP}:{API_PORT}"
LEASE_TTL_S = 10
POLL_DEADLINE_S = 10  # --worker-poll-deadline in the rig (the default is 30): a partition is noticed sooner
TERMINAL = {"completed", "failed", "expired", "cancelled"}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) ")


class Cluster:
    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.cli = InNamespace("cli")
        self.timings: dict[str, float] = {}
        self.killed_index: int | None = None  # the worker of the node the node-kill scenario killed

    # -- Ray ------------------------------------------------------------------------------------------
    def ray_status(self) -> str:
        env = [f"{k}={v}" for k, v in self.rig.env().items()]
        out = subprocess.run(
            ["ip", "netns", "exec", "bgt-head", "env", "-i", *env, "ray", "status", "--address", GCS],
            capture_output=True,
            text=True,
            timeout=60,
        )
        return out.stdout + out.stderr

    def live_nodes(self) -> int:
        status = self.ray_status()
        active = status.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in status else ""
        return active.count("node_")

    def wait_nodes(self, count: int, timeout: float = 120) -> None:
        wait_until(lambda: self.live_nodes() >= count, timeout, f"{count} live Ray nodes", interval=1.0)

    # -- the service on the head ------------------------------------------------------------------------
    def serve(self, *extra: str) -> float:
        """`bulkgen serve --ray-address` in the head namespace (a PID namespace of its own); -> start seconds."""
        self.rig.kill("serve")
        argv = [
            "python",
            "-m",
            "bulkgen",
            "serve",
            "--host",
            HEAD_IP,
            "--port",
            str(API_PORT),
            "--ray-address",
            GCS,
            "--storage",
            STORAGE,
            "--range-size",
            "16",
            "--lease-ttl",
            str(LEASE_TTL_S),
            "--worker-poll-deadline",
            str(POLL_DEADLINE_S),
            *extra,
        ]
        t0 = time.monotonic()
        proc = self.rig.spawn("serve", "head", argv, on_node=True)  # a process of the head node

        def healthy() -> bool:
            assert proc.poll() is None, f"bulkgen serve exited:\n{self.serve_log()[-3000:]}"
            try:
                return self.cli.run(lambda: urllib.request.urlopen(f"{API}/health", timeout=2).status) == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_until(healthy, 240, "bulkgen serve answering /health", interval=0.3)
        return time.monotonic() - t0

    def serve_log(self) -> str:
        return self.rig.log_text("serve")

    def log_line(self, pattern: str, after: int = 0) -> tuple[datetime, str] | None:
        """The first service log line matching `pattern` after character `after`: (its time, the line)."""
        for line in self.serve_log()[after:].splitlines():
            m = STAMP.match(line)
            if m and re.search(pattern, line):
                return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f"), line
        return None

    # -- clients, in the client namespace ---------------------------------------------------------------
    def openai(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{API}/v1", api_key="unused", max_retries=0, timeout=30)

    def submit(self, rows: list[dict], name: str):
        path = self.rig.root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

        def create():
            c = self.openai()
            with path.open("rb") as f:
                file_id = c.files.create(file=(path.name, f), purpose="batch").id
            return c.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )

        return self.cli.run(create)

    def batch(self, batch_id: str):
        """The batch, or None while the API does not answer (the head is down)."""
        try:
            return self.cli.run(lambda: self.openai().batches.retrieve(batch_id))
        except Exception:
            return None

    def results(self, batch) -> tuple[list[dict], list[dict]]:
        def lines(file_id):
            if not file_id:
                return []
            text = self.cli.run(lambda: self.openai().files.content(file_id).text)
            return [json.loads(x) for x in text.splitlines() if x.strip()]

        return lines(batch.output_file_id), lines(batch.error_file_id)

    def workers(self) -> dict[int, str | None]:
        """Worker index -> its node's IP, from the service's dashboard API."""
        body = self.cli.run(lambda: urllib.request.urlopen(f"{API}/v1/dashboard/workers", timeout=10).read())
        return {w["index"]: w["node_ip"] for w in json.loads(body)["data"]}

    def in_flight(self, index: int, batch_id: str) -> int:
        """Requests of `batch_id` that worker `index` holds now, from the dashboard API."""
        body = self.cli.run(lambda: urllib.request.urlopen(f"{API}/v1/dashboard/workers", timeout=10).read())
        for w in json.loads(body)["data"]:
            if w["index"] == index:
                return sum(b["requests_in_flight"] for b in w["batches"] if b["id"] == batch_id)
        return 0

    def s3(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=S3_URL,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    def parts(self, batch_id: str) -> dict[str, bytes]:
        """The batch's stored result parts (key -> body), read over S3 from the client namespace."""

        def read():
            s3 = self.s3()
            listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"bulkgen/parts/{batch_id}/lines-")
            return {
                o["Key"]: s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
                for o in listed.get("Contents", [])
            }

        return self.cli.run(read)

    def keys(self, prefix: str) -> list[str]:
        listed = self.cli.run(lambda: self.s3().list_objects_v2(Bucket=BUCKET, Prefix=f"bulkgen/{prefix}"))
        return [o["Key"] for o in listed.get("Contents", [])]

    def timing(self, name: str, seconds: float) -> None:
        self.timings[name] = round(seconds, 1)
        print(f"cluster timing {name}: {seconds:.1f} s", flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call":
        item.cluster_failed = outcome.get_result().failed


@pytest.fixture(autouse=True)
def logs_on_failure(request):
    """A failed scenario prints the tails of the service's and the engine actors' logs (CI shows only the
    output; the rig's folder goes at teardown), and the rig's logs are kept in CLUSTER_LOGS."""
    yield
    if "cluster" not in request.fixturenames or not getattr(request.node, "cluster_failed", False):
        return
    c: Cluster = request.getfixturevalue("cluster")
    print(f"--- {request.node.name}: the service's log, last lines ---\n{_tail(c.serve_log(), 80)}")
    for node in ("head", "a", "b"):
        print(f"--- engine actors on {node}, last lines ---\n{_tail(c.rig.worker_logs(node), 30)}")
    _keep_logs(c.rig)


CLUSTER_LOGS = Path(os.environ.get("BULKGEN_CLUSTER_LOGS", "/tmp/bgt-logs"))


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _keep_logs(rig: Rig) -> None:
    shutil.rmtree(CLUSTER_LOGS, ignore_errors=True)
    shutil.copytree(rig.logs, CLUSTER_LOGS, dirs_exist_ok=True)
    for node in ("head", "a", "b"):
        (CLUSTER_LOGS / f"actors-{node}.log").write_text(rig.worker_logs(node))
    print(f"cluster logs kept in {CLUSTER_LOGS}", flush=True)


@pytest.fixture(scope="module")  # down again before the rest of the suite: idle nodes still cost CPU
def cluster():
    try:
        check_available()
    except RigUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    root = Path(f"/tmp/bgt-{os.getpid()}")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    rig = Rig(root)
    atexit.register(rig.down)  # a second net: an interrupted session still kills what it started
    c = None
    t0 = time.monotonic()
    try:
        took = rig.up()
        c = Cluster(rig)
        c.wait_nodes(3)
        c.cli.run(lambda: c.s3().create_bucket(Bucket=BUCKET))
        c.timing("cluster_up", time.monotonic() - t0)
        for name, seconds in took.items():
            c.timing(f"ray_start_{name}", seconds)
        c.timing("serve_start", c.serve())
        yield c
    finally:
        if c is not None:
            c.cli.close()
            print(f"cluster timings: {json.dumps(c.timings)}; load average {os.getloadavg()}", flush=True)
        rig.down()
        shutil.rmtree(root, ignore_errors=True)
