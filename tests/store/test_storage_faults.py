"""Storage that cannot be used is one StorageUnavailable naming the storage and why, everywhere:
in the store, at every command's startup (one line, non-zero exit), never a botocore traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bulkgen.store import StorageUnavailable, open_store
from tests.support.s3 import FAST_RETRY
from tests.support.service import free_port

ROOT = Path(__file__).resolve().parents[2]


def _refused() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there: connections are refused


def test_unreachable_endpoint(s3_server):
    endpoint = _refused()
    store = open_store("s3://bucket/x", endpoint_url=endpoint, retry_attempts=2, **FAST_RETRY)
    with pytest.raises(StorageUnavailable) as err:
        store.check()
    assert (
        str(err.value) == f"storage s3://bucket/x is unavailable: unreachable: cannot connect to {endpoint}"
    )
    with pytest.raises(StorageUnavailable, match="unreachable"):
        store.read_bytes("batches/a.json")
    with pytest.raises(StorageUnavailable, match="unreachable"):
        list(store.list("files/"))


def test_missing_bucket(s3_server):
    store = open_store("s3://no-such-bucket-here/x", endpoint_url=s3_server, **FAST_RETRY)
    with pytest.raises(
        StorageUnavailable, match=r"^storage s3://no-such-bucket-here/x is unavailable: no such bucket$"
    ):
        store.check()


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("403", r"access denied \(AccessDenied\)"),
        (
            "badkey",
            r"bad credentials \(InvalidAccessKeyId: The AWS Access Key Id you provided does not exist",
        ),
    ],
)
def test_denied_and_bad_credentials_are_named_and_not_retried(s3_bucket_url, flaky_proxy, mode, reason):
    store = open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, **FAST_RETRY)
    flaky_proxy.down = mode
    with pytest.raises(StorageUnavailable, match=f"^storage {s3_bucket_url} is unavailable: {reason}"):
        store.check()
    with pytest.raises(StorageUnavailable, match=reason):
        store.write_bytes("k", b"v")
    assert len(flaky_proxy.log) == 2  # an answer, not a fault: one request each


def test_lasting_5xx_is_unavailable_after_the_retries(s3_bucket_url, flaky_proxy):
    store = open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, retry_attempts=3, **FAST_RETRY)
    flaky_proxy.down = "500"
    with pytest.raises(StorageUnavailable, match="kept answering 500 InternalError after the retries"):
        store.read_bytes("k")
    with pytest.raises(StorageUnavailable, match="kept answering 500 after the retries"):
        store.size("k")  # a HEAD answer has no body, so no error code
    assert len(flaky_proxy.log) == 6


def test_local_folder_that_cannot_be_made(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    store = open_store(str(tmp_path / "file" / "storage"))
    with pytest.raises(
        StorageUnavailable, match=r"storage .*/file/storage is unavailable: cannot create the folder"
    ):
        store.create()
    with pytest.raises(
        StorageUnavailable, match=r"storage .*/file/storage is unavailable: cannot look at the folder"
    ):
        store.check()


def _command(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "bulkgen", "serve"],
        ["-m", "bulkgen", "run", "samples/completions.jsonl", "-o", "{tmp}/out.jsonl"],
        ["-m", "bulkgen", "gc"],
        ["jobs/batch_job.py", "--input", "inbox/x.jsonl"],
    ],
)
def test_every_command_says_which_storage_in_one_line(command, tmp_path):
    endpoint = _refused()
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    out = _command(*args, "--storage", "s3://bulkgen-bucket/prefix", "--endpoint-url", endpoint)
    assert out.returncode == 1, out.stderr
    assert out.stderr == (
        f"Error: storage s3://bulkgen-bucket/prefix is unavailable: unreachable: cannot connect "
        f"to {endpoint}\n"
    )
    assert "Traceback" not in out.stdout + out.stderr


def test_local_folder_that_goes_away_while_in_use(tmp_path):
    import shutil

    store = open_store(str(tmp_path / "storage"))
    store.create()
    store.write_bytes("batches/a.json", b"{}")
    shutil.rmtree(tmp_path / "storage")
    (tmp_path / "storage").write_text("a file where the folder was")
    with pytest.raises(StorageUnavailable, match=r"storage .*/storage is unavailable: it is not a folder"):
        store.write_bytes("batches/b.json", b"{}")
    with pytest.raises(StorageUnavailable, match="it is not a folder"):
        store.check()
    with pytest.raises(StorageUnavailable, match="it is not a folder"):
        store.read_bytes("batches/a.json")  # never a plain "no such key"
