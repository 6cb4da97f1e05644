"""A local storage folder removed or replaced under a running service: 503 storage_unavailable and /health
degraded until the operator puts it back, never a silently re-created empty storage or a 404.

A real service (uvicorn on 127.0.0.1; no workers needed) driven by the openai client.
"""

from __future__ import annotations

import json
import logging
import os
from urllib.request import urlopen

import openai
import pytest

from bulkgen.store import LocalStore
from tests.service.api_only import ApiOnly


@pytest.fixture
def api(tmp_path):
    service = ApiOnly(LocalStore(tmp_path / "store", fsync=False))  # made at its start, as by `bulkgen serve`
    service.app.state.storage_probe.max_age_s = 0
    yield service, tmp_path / "store", tmp_path / "aside"
    service.stop()


def _health(root: str) -> dict:
    with urlopen(f"{root}/health") as response:
        assert response.status == 200
        return json.loads(response.read())


def _all_unavailable(client, file_id: str, folder, reason: str, caplog) -> None:
    """503 in OpenAI's shape, saying only that storage is down: where it is (an absolute path on the
    server) and why are the operator's, in the log."""
    caplog.clear()
    for call in (
        client.files.list,
        lambda: client.files.retrieve(file_id),
        lambda: client.files.content(file_id),
        client.batches.list,
        lambda: client.files.create(file=("b.jsonl", b"{}\n"), purpose="batch"),
    ):
        with pytest.raises(openai.InternalServerError) as err:
            call()
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "5"
        assert err.value.body == {
            "message": "storage unavailable; try again later",
            "type": "server_error",
            "param": None,
            "code": "storage_unavailable",
        }
        assert str(folder) not in err.value.response.text
    logged = [r.getMessage() for r in caplog.records if r.name == "bulkgen.api.errors"]
    assert len(logged) == 5 and all(str(folder) in m and reason in m for m in logged), logged


@pytest.mark.parametrize("how", ["removed", "replaced by a file"])
def test_a_storage_folder_gone_answers_503_until_it_is_back(api, how, caplog):
    caplog.set_level(logging.WARNING, "bulkgen.api.errors")
    service, folder, aside = api
    client = service.client()
    uploaded = client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    os.rename(folder, aside)
    if how == "replaced by a file":
        folder.write_text("not a folder")
    reason = "does not exist" if how == "removed" else "it is not a folder"
    _all_unavailable(client, uploaded.id, folder, reason, caplog)
    health = _health(service.root)
    assert health["status"] == "degraded" and reason in health["storage"]
    assert folder.is_dir() is False  # never re-created, not even by the health check
    if how == "replaced by a file":
        folder.unlink()
    os.rename(aside, folder)  # the operator puts it back
    assert _health(service.root)["status"] == "ok"
    assert [f.id for f in client.files.list()] == [uploaded.id]
    assert client.files.retrieve(uploaded.id).id == uploaded.id
