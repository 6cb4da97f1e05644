"""Size limits enforced while bodies stream in, lines every reader can split, validation run by the runtime."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest

from bulkgen.batch.outputlines import json_line
from bulkgen.batch.service import BatchService
from tests.support.service import (
    Service,
    chat_row,
    read_lines,
    settings_for,
    upload,
    validated,
    wait_done,
    write_jsonl,
)
from tests.support.wait import wait_until

LIMIT = 1_000_000


@pytest.fixture
def small_limit(service, monkeypatch):
    monkeypatch.setattr(service.svc.settings, "max_file_bytes", LIMIT)
    return service


def _stored(service) -> tuple[list[str], list[Path]]:
    root = Path(service.svc.settings.storage)
    return list(service.svc.store.list("files/data/")), [p for p in root.rglob("*.tmp")]


def _settles_to(service, before, timeout: float = 10.0) -> bool:
    """The stored data objects and temp files come back to `before`. The session's service runs other
    tests' batches meanwhile, whose writes pass through short-lived temp files; a leaked one stays."""

    def settled() -> bool:
        data, temps = _stored(service)
        return data == before[0] and set(temps) <= set(before[1])

    return wait_until(
        settled,
        timeout,
        "the stored objects and temp files to come back",
        interval=0.05,
        details=lambda: str(_stored(service)),
    )


def _post(service, path: str, chunks, content_type: str, length: int | None = None) -> tuple[int, dict]:
    """A raw POST: a known Content-Length, or chunked transfer encoding (no length announced)."""
    url = urlparse(service.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = {"Content-Type": content_type, "Authorization": "Bearer k"}
    if length is not None:
        headers["Content-Length"] = str(length)
    try:
        conn.request("POST", url.path + path, body=chunks, headers=headers, encode_chunked=length is None)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused before the body's end: the answer is already on its way, the rest is not read
    response = conn.getresponse()
    status, body = response.status, json.loads(response.read())
    conn.close()
    return status, body


def _multipart(size: int, boundary: str = "b0undary"):
    yield (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    block = b"x" * 65536
    for start in range(0, size, len(block)):
        yield block[: min(len(block), size - start)]
    yield f"\r\n--{boundary}--\r\n".encode()


def test_upload_over_the_limit_is_refused_while_streaming_and_nothing_is_stored(small_limit):
    before = _stored(small_limit)
    status, body = _post(
        small_limit, "/files", _multipart(8 * LIMIT), "multipart/form-data; boundary=b0undary"
    )
    assert status == 413 and body["error"]["code"] == "file_too_large" and body["error"]["param"] == "file"
    assert f"limit of {LIMIT} bytes" in body["error"]["message"]
    assert _settles_to(small_limit, before)  # no data object, no temp file left behind
    status, body = _post(small_limit, "/files", _multipart(LIMIT), "multipart/form-data; boundary=b0undary")
    assert status == 200 and body["bytes"] == LIMIT and body["purpose"] == "batch"  # exactly the limit: fine


def test_upload_with_a_large_declared_length_is_refused_before_storing(small_limit, client):
    before = _stored(small_limit)
    with pytest.raises(openai.APIStatusError) as info:
        client.files.create(file=("big.jsonl", b"y" * (3 * LIMIT)), purpose="batch")
    assert info.value.status_code == 413 and info.value.code == "file_too_large"
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("ok.jsonl", b"{}\n"), purpose="fine-tune")  # refused after the upload…
    assert info.value.param == "purpose"
    assert _settles_to(small_limit, before)  # …and its bytes discarded


def test_json_body_over_a_megabyte_is_refused(service):
    big = json.dumps(
        {"input_file_id": "f", "endpoint": "/v1/chat/completions", "metadata": {"k": "v" * 3_000_000}}
    ).encode()
    status, body = _post(service, "/batches", big, "application/json", len(big))
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, body = _post(
        service, "/batches", iter([big[i : i + 65536] for i in range(0, len(big), 65536)]), "application/json"
    )  # chunked: counted as it arrives
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, body = _post(service, "/batches", b"{not json", "application/json", 9)
    assert status == 400 and body["error"]["code"] == "invalid_json"


def test_line_breaks_inside_strings_are_escaped_in_every_written_line():
    line = json_line({"custom_id": "a\u2028b\u0085c\u2029d", "text": "é\n"})
    assert line.count(b"\n") == 1 and b"\\u2028" in line and b"\\u0085" in line and "é".encode() in line
    assert len(line.decode().splitlines()) == 1
    assert json.loads(line)["custom_id"] == "a\u2028b\u0085c\u2029d"


def test_output_and_error_files_split_into_their_lines(client, tmp_path):
    ids = ["ok\u2028one", "ok\u0085two", "too\u2029long"]
    rows = [
        chat_row(ids[0], "a\u2028b", max_tokens=2),
        chat_row(ids[1], "c", max_tokens=2),
        chat_row(ids[2], "x", max_tokens=100_000),
    ]  # refused at run time: an error-file line
    batch = wait_done(
        client,
        client.batches.create(
            input_file_id=upload(client, write_jsonl(tmp_path / "u.jsonl", rows)).id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        ).id,
    )
    assert batch.status == "completed" and batch.request_counts.failed == 1
    out = client.files.content(batch.output_file_id).text
    assert len(out.splitlines()) == 2 and "\u2028" not in out
    assert [line["custom_id"] for line in read_lines(client, batch.output_file_id)] == ids[:2]
    (error,) = read_lines(client, batch.error_file_id)
    assert error["custom_id"] == ids[2] and error["response"]["status_code"] == 400


def test_a_batch_left_validating_is_validated_by_the_next_runtime(tmp_path):
    """Validation is the runtime's work: a batch accepted just before a restart is not lost in `validating`."""
    settings = settings_for(str(tmp_path / "store"))
    accepted = BatchService(settings)
    good = write_jsonl(tmp_path / "g.jsonl", [chat_row(f"r{i}", "hi", max_tokens=2) for i in range(3)])
    bad = write_jsonl(tmp_path / "b.jsonl", [{**chat_row("r", "hi"), "method": "GET"}])  # the file's error
    ids = []
    for path in (good, bad):
        with path.open("rb") as f:
            file_id = accepted.files.create(f, path.name, "batch")["id"]
        ids.append(accepted.create_batch(file_id, "/v1/chat/completions", "24h", None).id)
    assert {accepted.batches.get(i).status for i in ids} == {"validating"}
    service = Service(settings)  # the service starts: its runtime finds both in the active index
    try:
        client = service.client()
        done, failed = wait_done(client, ids[0]), validated(client, ids[1])
        assert done.status == "completed" and done.request_counts.completed == 3
        assert failed.status == "failed" and [(e.line, e.param) for e in failed.errors.data] == [
            (1, "method")
        ]
    finally:
        service.stop()


def test_uploads_stream_into_s3_and_a_refused_one_leaves_no_object(s3_bucket_url, s3_server):
    """On S3 the file part goes up as a multipart upload while it arrives; past the limit it is aborted."""
    import boto3

    service = Service(settings_for(s3_bucket_url, endpoint_url=s3_server, max_file_bytes=20 * 2**20))
    try:
        status, body = _post(
            service, "/files", _multipart(12 * 2**20), "multipart/form-data; boundary=b0undary"
        )
        assert status == 200 and body["bytes"] == 12 * 2**20  # above the 8 MiB multipart threshold
        assert service.client().files.content(body["id"]).content == b"x" * (12 * 2**20)
        status, refused = _post(
            service, "/files", _multipart(30 * 2**20), "multipart/form-data; boundary=b0undary"
        )
        assert status == 413 and refused["error"]["code"] == "file_too_large"
    finally:
        service.stop()
    bucket, prefix = s3_bucket_url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    data = [
        o["Key"]
        for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/files/data/").get("Contents", [])
    ]
    assert data == [f"{prefix}/files/data/{body['id']}"]
    assert not s3.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_many_concurrent_uploads_all_arrive(service):
    """Each upload's store thread is its own, and waiting on a full pipe holds no thread: 48 uploads of 5 MB
    at once (more than the server's thread pool, each more than its pipe holds) all finish."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[int, int]:
        status, body = _post(
            service, "/files", _multipart(5 * LIMIT + i), "multipart/form-data; boundary=b0undary"
        )
        if status == 200:
            service.svc.files.delete(body["id"])
        return status, body.get("bytes", -1)

    with ThreadPoolExecutor(48) as pool:
        results = list(pool.map(one, range(48)))
    assert results == [(200, 5 * LIMIT + i) for i in range(48)]
