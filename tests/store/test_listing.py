"""Listings page through storage keys: O(page) reads, and a cursor is a position that need not exist."""

from __future__ import annotations

import io
import json
import time

import pytest

from bulkgen.batch.batchrecord import new_batch_record
from bulkgen.batch.records import BatchRepo, FileRepo, RecordNotFound
from bulkgen.store import LocalStore


class CountingStore(LocalStore):
    """A real local store that counts the objects it reads and the listings it starts (read_versioned
    reads through read_bytes here, so every read is counted once)."""

    def __init__(self, root) -> None:
        super().__init__(root, fsync=False)
        self.reads = self.listings = 0

    def read_bytes(self, key):
        self.reads += 1
        return super().read_bytes(key)

    def list(self, prefix, *, start_after=None):
        self.listings += 1
        return super().list(prefix, start_after=start_after)


def _files(repo: FileRepo, count: int, **kw) -> list[str]:
    return [repo.create(io.BytesIO(b"{}\n"), f"f{i}.jsonl", "batch", **kw)["id"] for i in range(count)]


def _pages(list_page, limit: int, id_of=lambda file: file["id"]) -> list[list[str]]:
    pages, after = [], None
    while True:
        items, has_more = list_page(after, limit)
        pages.append([id_of(r) for r in items])
        if not has_more:
            return pages
        after = pages[-1][-1]


@pytest.mark.parametrize("order", ["desc", "asc"])
def test_pages_cover_every_file_once_in_order(store, order):
    repo = FileRepo(store)
    ids = sorted(_files(repo, 8))  # ids sort newest first
    expected = ids if order == "desc" else ids[::-1]
    pages = _pages(lambda after, limit: repo.list(after, limit, order), 3)
    assert [len(p) for p in pages] == [3, 3, 2]
    assert sum(pages, []) == expected


def test_batches_page_newest_first(store):
    repo = BatchRepo(store)
    ids = sorted(repo.create(new_batch_record("file-x", "/v1/completions", "24h", None)).id for _ in range(5))
    assert sum(_pages(repo.list, 2, lambda batch: batch.id), []) == ids


@pytest.mark.parametrize("order", ["desc", "asc"])
def test_a_deleted_cursor_is_still_a_position(store, order):
    """The SDK's list-and-delete loop: each page's `after` is an id deleted a moment ago."""
    repo = FileRepo(store)
    ids = _files(repo, 11)
    seen, after = [], None
    while True:
        items, has_more = repo.list(after, 4, order)
        for item in items:
            repo.delete(item["id"])
        seen += [r["id"] for r in items]
        if not has_more:
            break
        after = items[-1]["id"]
    assert sorted(seen) == sorted(ids)
    assert repo.list(None, 100, order) == ([], False)


@pytest.mark.parametrize("order", ["desc", "asc"])
def test_a_page_reads_only_its_records(tmp_path, order):
    store = CountingStore(tmp_path / "s")
    store.create()  # a local storage folder is made only on purpose (as `bulkgen serve` does at start)
    repo = FileRepo(store)
    ids = sorted(_files(repo, 200))
    cursor = ids[100]
    store.reads = 0
    items, has_more = repo.list(cursor, 2, order)
    assert [r["id"] for r in items] == (ids[101:103] if order == "desc" else ids[99:97:-1])
    assert has_more
    assert store.reads == 3  # the page and the one that says has_more, whatever else is stored


def test_expired_files_are_gone_before_gc(store):
    repo = FileRepo(store)
    (kept,) = _files(repo, 1)
    (old,) = _files(repo, 1, expires_after_s=3600)
    record = json.loads(store.read_bytes(repo.meta_key(old)))
    record["expires_at"] = int(time.time()) - 1  # as it will be an hour from now
    store.write_bytes(repo.meta_key(old), json.dumps(record).encode())
    with pytest.raises(RecordNotFound, match=f"^No such file: '{old}'$"):  # as an unknown id
        repo.get(old)
    with pytest.raises(RecordNotFound):
        repo.open(old)
    for order in ("asc", "desc"):
        assert [r["id"] for r in repo.list(None, 10, order)[0]] == [kept]
    assert repo.get(old, include_expired=True)["id"] == old


def _counting_scandir(monkeypatch, folder) -> list[int]:
    """Count the reads of `folder`'s names (every listing of a local folder starts with one)."""
    import os

    reads, plain = [0], os.scandir

    def scandir(path="."):
        reads[0] += os.fspath(path) == os.fspath(folder)
        return plain(path)

    monkeypatch.setattr(os, "scandir", scandir)
    return reads


def _age(folder, seconds: float = 60) -> None:
    """As if the folder last changed `seconds` ago (a listing keeps an index only of a folder settled)."""
    import os

    old = time.time() - seconds
    os.utime(folder, (old, old))


def test_local_pages_read_the_folders_names_once_while_it_is_unchanged(tmp_path, monkeypatch):
    """Ten pages of 20 out of 300 stored batches: the folder's names are read once, not once a page (a
    page is a stat and a bisect); a batch added afterwards is listed at once."""
    store = LocalStore(tmp_path / "s", fsync=False)
    store.create()
    repo = BatchRepo(store)
    for _ in range(300):
        repo.create(new_batch_record("file-x", "/v1/completions", "24h", None))
    folder = tmp_path / "s" / "batches"
    _age(folder)
    reads = _counting_scandir(monkeypatch, folder)
    after = None
    for _ in range(10):
        items, has_more = repo.list(after, 20)
        assert len(items) == 20 and has_more
        after = items[-1].id
    assert reads[0] <= 1
    new = repo.create(new_batch_record("file-x", "/v1/completions", "24h", None))
    assert repo.list(None, 1)[0][0].id == new.id  # newest first: the changed folder is read again
    assert reads[0] <= 2


def test_a_folder_changed_within_its_clock_tick_is_never_listed_stale(tmp_path):
    """A change that leaves the folder's mtime as it was (two writes in one coarse clock tick) is still
    listed: a folder that changed in the last RACY_S seconds is read again at every listing."""
    import os

    store = LocalStore(tmp_path / "s", fsync=False)
    store.create()
    store.write_bytes("f/a", b"1")
    folder = tmp_path / "s" / "f"
    mtime = os.stat(folder).st_mtime_ns
    assert list(store.list("f/")) == ["f/a"]
    store.write_bytes("f/b", b"2")
    os.utime(folder, ns=(mtime, mtime))  # the same tick as the listing above
    assert list(store.list("f/")) == ["f/a", "f/b"]


def test_an_s3_page_asks_for_a_page_of_keys_not_a_thousand(s3_bucket_url):
    """A page of 20 out of 150 stored batches: S3 is asked for at most 64 keys (it was 1,000: the
    answer, and its parsing, grew with what is stored up to 1,000 objects)."""
    from bulkgen.store import open_store

    store = open_store(s3_bucket_url)
    repo = BatchRepo(store)
    for _ in range(150):
        repo.create(new_batch_record("file-x", "/v1/completions", "24h", None))
    client, asked = store._client(), []
    plain = client.list_objects_v2

    def list_objects_v2(**request):
        page = plain(**request)
        asked.append(len(page.get("Contents", [])))
        return page

    client.list_objects_v2 = list_objects_v2
    items, has_more = repo.list(None, 20)
    assert len(items) == 20 and has_more
    assert sum(asked) <= 64, asked
    assert len(repo.list(None, 100)[0]) == 100  # a longer page asks for more
