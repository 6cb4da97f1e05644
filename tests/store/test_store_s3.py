"""S3-only behaviour against moto over real HTTP: pagination, multipart upload, endpoints, retries."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest

from bulkgen.store import NotFound, PreconditionFailed, S3Store, StorageUnavailable, open_store

FAST_RETRY = {"retry_base_delay": 0.01, "retry_max_delay": 0.05}


def _fill(store, keys):
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: store.write_bytes(key, b"."), keys))


def test_listing_follows_every_page_past_1000(s3_bucket_url):
    store = open_store(s3_bucket_url)
    keys = [f"parts/{i:05d}" for i in range(1050)]
    _fill(store, keys)
    assert list(store.list("parts/")) == keys
    assert list(store.list("parts/", start_after="parts/00998")) == keys[999:]
    assert store.delete_prefix("parts/") == 1050
    assert list(store.list("")) == []


def test_small_pages_give_the_same_listing(s3_bucket_url, flaky_proxy):
    store = open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, page_size=7)
    keys = [f"k/{i:03d}" for i in range(30)]
    _fill(store, keys)
    flaky_proxy.log.clear()
    assert list(store.list("k/", start_after="k/002")) == keys[3:]
    assert len(flaky_proxy.log) == 4  # 27 keys in pages of 7


def test_large_upload_takes_the_multipart_path(s3_bucket_url):
    store = open_store(s3_bucket_url)  # default threshold and part size: 8 MiB
    body = bytes(range(256)) * (9 * 4096 + 3)  # a little over 9 MiB
    assert store.upload_fileobj("files/big", io.BytesIO(body)) == len(body)
    _, version = store.read_versioned("files/big")
    assert version.strip('"').endswith("-2")  # a multipart ETag names its part count
    assert store.read_bytes("files/big") == body


def test_small_upload_is_a_single_put(s3_bucket_url):
    store = open_store(s3_bucket_url)
    store.upload_fileobj("files/small", io.BytesIO(b"abc"))
    assert "-" not in store.read_versioned("files/small")[1]


def test_endpoint_from_environment_and_explicit(s3_bucket_url, s3_server, monkeypatch):
    assert open_store(s3_bucket_url).endpoint_url == s3_server  # AWS_ENDPOINT_URL, set by the fixture
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    explicit = open_store(s3_bucket_url, endpoint_url=s3_server)
    explicit.write_bytes("k", b"v")
    assert open_store(**explicit.open_args()).read_bytes("k") == b"v"


def test_store_root_prefix_is_respected(s3_bucket_url, s3_server):
    store = open_store(s3_bucket_url)
    store.write_bytes("a/b", b"x")
    bucket = store.bucket
    raw = boto3.client("s3", endpoint_url=s3_server).list_objects_v2(Bucket=bucket)
    assert [item["Key"] for item in raw["Contents"]] == ["prefix/a/b"]
    whole_bucket = open_store(f"s3://{bucket}")
    assert list(whole_bucket.list("")) == ["prefix/a/b"]


def test_missing_bucket_is_not_reported_as_a_missing_key(s3_server):
    store = open_store("s3://no-such-bucket-here/x", endpoint_url=s3_server, **FAST_RETRY)
    with pytest.raises(StorageUnavailable, match="s3://no-such-bucket-here/x is unavailable: no such bucket"):
        store.read_bytes("k")


def test_throttling_is_retried_until_it_succeeds(s3_bucket_url, flaky_proxy):
    store = open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, **FAST_RETRY)
    flaky_proxy.fail = ["503", "503", "503"]
    store.write_bytes("k", b"v")
    assert [status for _, _, status in flaky_proxy.log] == [503, 503, 503, 200]
    flaky_proxy.fail = ["503"]
    assert store.read_bytes("k") == b"v"
    assert [status for _, _, status in flaky_proxy.log[-2:]] == [503, 200]


def test_dropped_connections_are_retried(s3_bucket_url, flaky_proxy):
    store = open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, **FAST_RETRY)
    store.write_bytes("k", b"v")
    flaky_proxy.fail = ["drop", "drop"]
    assert list(store.list("")) == ["k"]
    assert [status for _, _, status in flaky_proxy.log[-3:]] == [0, 0, 200]


def test_retries_give_up_after_the_attempt_limit(s3_bucket_url, flaky_proxy):
    store = open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, retry_attempts=3, **FAST_RETRY)
    flaky_proxy.fail = ["503"] * 5
    with pytest.raises(StorageUnavailable, match="kept answering 503 SlowDown after the retries"):
        store.read_bytes("k")
    assert len(flaky_proxy.log) == 3


def test_answers_are_not_retried(s3_bucket_url, flaky_proxy):
    store = open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, **FAST_RETRY)
    with pytest.raises(NotFound):
        store.read_bytes("missing")
    assert [status for _, _, status in flaky_proxy.log] == [404]
    version = store.write_bytes("k", b"v", if_none_match=True)
    flaky_proxy.log.clear()
    with pytest.raises(PreconditionFailed):
        store.write_bytes("k", b"w", if_match=version + "x")
    assert [status for _, _, status in flaky_proxy.log] == [412]


def test_a_retried_conditional_write_that_landed_is_not_reported_as_lost(s3_bucket_url, flaky_proxy):
    """The first put lands but its answer is lost; the retry sees 412, yet the write is ours."""
    store = open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, **FAST_RETRY)
    flaky_proxy.fail = ["lost"]
    version = store.write_bytes("batches/b.json", b"record", if_none_match=True)
    assert [status for method, _, status in flaky_proxy.log if method == "PUT"] == [503, 412]
    assert store.read_versioned("batches/b.json") == (b"record", version)
    flaky_proxy.fail = ["lost"]
    with pytest.raises(PreconditionFailed):  # someone else's record is there: still a lost race
        store.write_bytes("batches/b.json", b"another record", if_none_match=True)


def test_uploads_survive_throttling(s3_bucket_url, flaky_proxy):
    store = open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, **FAST_RETRY)
    flaky_proxy.fail = ["503"]
    assert store.upload_fileobj("files/up", io.BytesIO(b"payload")) == 7
    assert store.read_bytes("files/up") == b"payload"


def test_bad_options_are_named(s3_server):
    with pytest.raises(ValueError, match="page_size"):
        S3Store("s3://bucket-x/p", endpoint_url=s3_server, page_size=0)
