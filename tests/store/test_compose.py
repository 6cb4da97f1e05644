"""Store.compose writes one object from byte ranges of others: on a local folder by streaming them, on S3
(moto over HTTP, behind the tests' counting proxy) by a multipart upload that copies ranges of 5 MiB and
more server-side (UploadPartCopy, no GET of their bytes) and uploads runs of shorter ones. Both give the
same bytes; a compose that fails leaves no object and no open upload."""

from __future__ import annotations

import boto3
import pytest

from bulkgen.store import NotFound, StorageUnavailable, open_store
from bulkgen.store.compose import MIN_PART, MiB, Span, plan_pieces
from bulkgen.store.s3 import parse_s3_url
from tests.support.s3 import FAST_RETRY


def layout(pieces) -> list[tuple[bool, list[tuple[str, int, int]]]]:
    return [(p.copy, [(s.key, s.start, s.end) for s in p.spans]) for p in pieces]


def test_short_spans_are_grouped_into_uploads_of_the_upload_size():
    spans = [Span(f"k{i}", 0, 3) for i in range(7)]
    assert layout(plan_pieces(spans, upload_size=6, min_part=5, max_part=100)) == [
        (False, [(f"k{i}", 0, 3) for i in (0, 1)]),
        (False, [(f"k{i}", 0, 3) for i in (2, 3)]),
        (False, [(f"k{i}", 0, 3) for i in (4, 5)]),
        (False, [("k6", 0, 3)]),  # the last part may be short
    ]


def test_a_long_span_is_copied_after_topping_up_the_short_run_before_it():
    spans = [Span("a", 0, 2), Span("big", 10, 22), Span("b", 0, 1), Span("big2", 0, 5)]
    assert layout(plan_pieces(spans, upload_size=8, min_part=5, max_part=100)) == [
        (False, [("a", 0, 2), ("big", 10, 13)]),  # 3 bytes of "big" make the first part 5 long
        (True, [("big", 13, 22)]),
        (False, [("b", 0, 1), ("big2", 0, 5)]),  # 5 - 4 = 1 byte left to copy: read, not copied
    ]


def test_a_span_over_the_largest_part_is_copied_in_equal_parts():
    assert layout(plan_pieces([Span("huge", 0, 25)], upload_size=8, min_part=5, max_part=10)) == [
        (True, [("huge", 0, 9)]),
        (True, [("huge", 9, 18)]),
        (True, [("huge", 18, 25)]),
    ]


def test_more_than_ten_thousand_parts_is_refused():
    with pytest.raises(ValueError, match="at most 10000"):
        list(plan_pieces([Span("k", 0, 10_001)], upload_size=1, min_part=1, max_part=1))


def objects() -> dict[str, bytes]:
    """Small parts of a few KB and two long ones: big-2 (12 MiB) lends the short run before it the bytes
    it lacks of 5 MiB and is copied from there on; big-1 (6 MiB) would keep under 5 MiB to copy, so it is read."""
    found = {f"parts/small-{i:03d}": (f"line {i} ".encode() * 300)[: 2_000 + 37 * i] for i in range(40)}
    found["parts/big-1"] = bytes(range(256)) * (6 * MiB // 256)
    found["parts/big-2"] = b"0123456789abcdef" * (12 * MiB // 16)
    return found


def spans_of(data: dict[str, bytes], keys: list[str]) -> list[Span]:
    """Each object whole except small-005 (its bytes 100..500) and big-2 (from byte 7 on)."""
    cut = {"parts/small-005": (100, 500), "parts/big-2": (7, 12 * MiB)}
    return [Span(k, *cut.get(k, (0, len(data[k])))) for k in keys]


def expected(data: dict[str, bytes], spans: list[Span | bytes]) -> bytes:
    return b"".join(s if isinstance(s, bytes) else data[s.key][s.start : s.end] for s in spans)


@pytest.fixture
def stores(tmp_path, s3_bucket_url, flaky_proxy):
    local = open_store(str(tmp_path / "store"))
    local.create()
    return local, open_store(s3_bucket_url, endpoint_url=flaky_proxy.url, **FAST_RETRY)


def fill(stores, data: dict[str, bytes]) -> None:
    for store in stores:
        for key, value in data.items():
            store.write_bytes(key, value)


def test_short_spans_compose_to_the_local_bytes_with_uploads_only(stores, flaky_proxy):
    data = {k: v for k, v in objects().items() if "small" in k}
    fill(stores, data)
    spans = spans_of(data, sorted(data))
    spans[3:3] = [b"bytes already read\n"]
    local, s3 = stores
    start = len(flaky_proxy.log)
    assert local.compose("out/all", spans) == s3.compose("out/all", spans) == len(expected(data, spans))
    assert local.read_bytes("out/all") == s3.read_bytes("out/all") == expected(data, spans)
    writes = [(m, p) for m, p, _ in flaky_proxy.log[start:] if m in ("PUT", "POST")]
    assert len(writes) == 1 and "uploadId" not in writes[0][1]  # under 5 MiB: one plain PUT
    assert not [r for r in flaky_proxy.ranged if "x-amz-copy-source" in r[2]]


def test_long_spans_are_copied_server_side_and_never_downloaded(stores, flaky_proxy):
    data = objects()
    fill(stores, data)
    keys = [*sorted(k for k in data if "small" in k)[:20], "parts/big-2", "parts/small-030", "parts/big-1"]
    keys += sorted(k for k in data if "small" in k)[31:]
    spans = spans_of(data, keys)
    local, s3 = stores
    start, ranged_start = len(flaky_proxy.log), len(flaky_proxy.ranged)
    assert s3.compose("out/all", spans) == local.compose("out/all", spans) == len(expected(data, spans))
    log, ranged = flaky_proxy.log[start:], flaky_proxy.ranged[ranged_start:]
    copies = [(path, h) for method, path, h in ranged if "x-amz-copy-source" in h]
    assert len(copies) == 1 and "partNumber=" in copies[0][0] and "uploadId=" in copies[0][0]
    bucket, root = parse_s3_url(s3.url)
    assert copies[0][1]["x-amz-copy-source"].endswith(f"{root}/parts/big-2")
    top_up = MIN_PART - sum(s.size for s in spans[:20])  # what the part before the copy took of big-2
    assert copies[0][1]["x-amz-copy-source-range"] == f"bytes={7 + top_up}-{12 * MiB - 1}"
    big2_gets = [(p, h) for m, p, h in ranged if m == "GET" and "big-2" in p]
    assert big2_gets == [(big2_gets[0][0], {"range": f"bytes=7-{7 + top_up - 1}"})]  # only the top-up
    assert sum(m == "GET" and "big-2" in p for m, p, _ in log) == 1
    assert local.read_bytes("out/all") == s3.read_bytes("out/all") == expected(data, spans)


def test_a_failed_compose_leaves_no_object_and_no_open_upload(stores, s3_server):
    data = objects()
    fill(stores[1:], data)
    _, s3 = stores
    spans = [*spans_of(data, ["parts/small-000", "parts/big-2"]), Span("parts/gone", 0, 6 * MiB)]
    with pytest.raises(NotFound):
        s3.compose("out/all", spans)
    assert not s3.exists("out/all")
    bucket, _ = parse_s3_url(s3.url)
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    s3.write_bytes("out/all", b"before")  # a rewrite that fails keeps what was there
    with pytest.raises(NotFound):
        s3.compose("out/all", spans)
    assert s3.read_bytes("out/all") == b"before"


def _completion(method: str, path: str) -> bool:
    """CompleteMultipartUpload: a POST naming the upload (its parts are PUTs)."""
    return method == "POST" and "uploadId=" in path


@pytest.mark.parametrize("retry_answer", [None, "nosuchupload"], ids=["moto-200", "NoSuchUpload"])
def test_a_completion_whose_answer_was_lost_is_recognized_by_its_etag(stores, flaky_proxy, retry_answer):
    """The first CompleteMultipartUpload lands but its answer is lost (SlowDown instead). The retry is
    answered 200 (moto, and S3 for a while: the completion is idempotent) or NoSuchUpload (S3 later, and
    MinIO); then the object, its ETag the one these parts give and its size the composed one, is taken as
    written with one HEAD. Either way compose returns and aborts nothing."""
    data = objects()
    fill(stores[1:], data)
    _, s3 = stores
    spans = spans_of(data, ["parts/small-000", "parts/big-2"])
    flaky_proxy.aimed = [(_completion, "lost"), (_completion, retry_answer)]
    start = len(flaky_proxy.log)
    assert s3.compose("out/all", spans) == len(expected(data, spans))
    assert s3.read_bytes("out/all") == expected(data, spans)
    log = flaky_proxy.log[start:]
    assert [status for m, p, status in log if _completion(m, p)] == [503, 404 if retry_answer else 200]
    assert [m for m, _, _ in log].count("HEAD") == (1 if retry_answer else 0)
    assert not [p for m, p, _ in log if m == "DELETE"]  # no abort


def test_a_lost_completion_over_an_object_changed_since_fails_clearly(stores, flaky_proxy, s3_server):
    """As above, but another writer replaced the object before the retry (answered NoSuchUpload): compose
    fails, saying what the key holds and what was composed, rather than report bytes that are not there."""
    data = objects()
    fill(stores[1:], data)
    _, s3 = stores
    spans = spans_of(data, ["parts/small-000", "parts/big-2"])
    bucket, root = parse_s3_url(s3.url)
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")

    def overwritten_before_the_retry(method: str, path: str) -> bool:
        if _completion(method, path):
            client.put_object(Bucket=bucket, Key=f"{root}/out/all", Body=b"another writer's bytes")
            return True
        return False

    flaky_proxy.aimed = [(_completion, "lost"), (overwritten_before_the_retry, "nosuchupload")]
    with pytest.raises(StorageUnavailable, match=r"out/all holds 22 bytes, ETag .* not the \d+ bytes"):
        s3.compose("out/all", spans)
    assert s3.read_bytes("out/all") == b"another writer's bytes"


def test_an_upload_gone_before_its_first_completion_fails_clearly(stores, flaky_proxy):
    """NoSuchUpload at the first try (the upload was aborted meanwhile, e.g. by a lifecycle rule): nothing
    of ours can be there, so compose fails naming the upload, without looking at the key."""
    data = objects()
    fill(stores[1:], data)
    _, s3 = stores
    flaky_proxy.aimed = [(_completion, "nosuchupload")]
    start = len(flaky_proxy.log)
    with pytest.raises(StorageUnavailable, match="the multipart upload of out/all is gone"):
        s3.compose("out/all", spans_of(data, ["parts/small-000", "parts/big-2"]))
    assert "HEAD" not in [m for m, _, _ in flaky_proxy.log[start:]]
    assert not s3.exists("out/all")
