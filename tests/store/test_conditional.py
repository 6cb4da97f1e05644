"""The one read-modify-write and the one TTL lease, on a real local store (no clock raced: a lapsed lease is
one written with ttl_s=0)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from bulkgen.store import LocalStore, NotFound
from bulkgen.store.conditional import TtlLease, update_json


def _bump(state: dict) -> dict:
    return {**state, "n": state["n"] + 1}


def test_concurrent_updates_lose_nothing(tmp_path):
    store = LocalStore(tmp_path, fsync=False)
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda _: update_json(store, "meta/n.json", _bump, missing={"n": 0}, attempts=500), range(80)
            )
        )
    assert json.loads(store.read_bytes("meta/n.json")) == {"n": 80}


def test_update_json_writes_nothing_when_change_returns_none_and_needs_missing_for_a_new_key(tmp_path):
    store = LocalStore(tmp_path, fsync=False)
    with pytest.raises(NotFound):
        update_json(store, "meta/n.json", _bump)
    assert update_json(store, "meta/n.json", lambda s: None, missing={"n": 0}) == ({"n": 0}, None)
    assert not store.exists("meta/n.json")
    assert update_json(store, "meta/n.json", _bump, missing={"n": 0}) == ({"n": 0}, {"n": 1})


def test_a_lease_excludes_others_while_live_and_carries_its_body_to_the_next_owner(tmp_path):
    store = LocalStore(tmp_path, fsync=False)
    live = TtlLease(store, "leases/a.json", "one", ttl_s=60)
    assert live.take({"step": 1}) and not live.retaken
    assert not TtlLease(store, "leases/a.json", "two", ttl_s=60).take(create_first=True)

    dying = TtlLease(store, "leases/b.json", "one", ttl_s=0)  # lapses as soon as it is written
    assert dying.take({"step": 1}, create_first=True) and dying.renew(step=2)
    heir = TtlLease(store, "leases/b.json", "two", ttl_s=60)
    assert heir.take({"step": 0}) and heir.retaken and heir.body["step"] == 2 and heir.body["owner"] == "two"
    assert not dying.renew(step=3)  # its version is gone: the heir holds the key
    dying.release()
    assert json.loads(store.read_bytes("leases/b.json"))["owner"] == "two"
    heir.release()
    assert not store.exists("leases/b.json")


def test_unless_refuses_a_stored_body(tmp_path):
    store = LocalStore(tmp_path, fsync=False)
    assert TtlLease(store, "watch/claims/h.json", "one", ttl_s=0).take({"state": "done"})
    assert not TtlLease(store, "watch/claims/h.json", "two", ttl_s=60).take(
        unless=lambda b: b["state"] == "done"
    )
