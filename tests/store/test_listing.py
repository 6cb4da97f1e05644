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
