"""Tenants and API keys: a keys file of hashes, 401 without a good key, and each tenant alone with its data.

A real service (uvicorn on 127.0.0.1, the workers of this test session) with two tenants, driven by the
openai client; other tenants' ids must look exactly like ids that never existed (404, never 403).
"""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from click.testing import CliRunner

from bulkgen.cli import cli
from bulkgen.tenants import KeyRing, KeysFileError, add_key, hash_key, read_keys_file
from tests.support.images import image_bytes
from tests.support.service import Service, chat_row, read_lines, settings_for, upload, wait_done, write_jsonl


def test_keys_file_holds_hashes_and_rejects_bad_lines(tmp_path):
    path = tmp_path / "keys"
    key = add_key(path, "team-a")
    assert key not in path.read_text() and hash_key(key) in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600
    ring = KeyRing.from_file(path)
    assert ring.resolve(key).tenant == "team-a"
    assert ring.resolve(key + "x") is None and ring.resolve("") is None and ring.resolve(None) is None

    second = add_key(path, "team-b")  # picked up without building a new ring (a running service)
    assert ring.resolve(second).tenant == "team-b" and ring.tenants() == ["team-a", "team-b"]

    path.write_text(path.read_text() + "team-c not-a-hash\n")
    with pytest.raises(KeysFileError, match=r"keys:3: expected 'TENANT KEY_SHA256'"):
        read_keys_file(path)
    assert ring.resolve(key) is None  # a broken edit fails closed (tests/service/test_keys_fail_closed.py)
    (tmp_path / "upper").write_text(f"Team {hash_key('k')}\n")
    with pytest.raises(KeysFileError, match="upper:1: tenant name 'Team' is not valid"):
        read_keys_file(tmp_path / "upper")


def test_keys_cli_prints_the_key_once_and_stores_its_hash(tmp_path):
    path = tmp_path / "keys"
    result = CliRunner().invoke(cli, ["keys", "add", "analytics", "--file", str(path)])
    assert result.exit_code == 0, result.output
    key = result.stdout.strip()
    assert key.startswith("bg-") and read_keys_file(path) == {hash_key(key): "analytics"}
    listed = CliRunner().invoke(cli, ["keys", "list", "--file", str(path)])
    assert listed.stdout == f"analytics\tsha256:{hash_key(key)[:16]}\n"
    bad = CliRunner().invoke(cli, ["keys", "add", "../evil", "--file", str(path)])
    assert bad.exit_code == 1 and "tenant name '../evil' is not valid" in bad.output


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    keys = root / "keys"
    key_a, key_b = add_key(keys, "team-a"), add_key(keys, "team-b")
    service = Service(settings_for(str(root / "store")), keyring=KeyRing.from_file(keys))
    yield service, key_a, key_b, root / "store"
    service.stop()


def _get(url: str, key: str | None = None) -> tuple[int, dict | str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, body = response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read().decode()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def test_keys_are_required_except_for_health(tenants):
    service, key_a, _, _ = tenants
    root = service.base_url.removesuffix("/v1")
    status, body = _get(service.base_url + "/files")
    assert (
        status == 401
        and body["error"]["code"] == "invalid_api_key"
        and "didn't provide" in body["error"]["message"]
    )
    with pytest.raises(openai.AuthenticationError):
        service.client(api_key="bg-wrong").files.list()
    assert _get(root + "/health")[0] == 200
    assert _get(root + "/metrics")[0] == 401
    status, text = _get(root + "/metrics", key_a)
    assert status == 200 and "bulkgen_batches" in text


def test_each_tenant_sees_only_its_own(tenants, tmp_path):
    service, key_a, key_b, storage = tenants
    a, b = service.client(api_key=key_a), service.client(api_key=key_b)
    file_a = upload(a, write_jsonl(tmp_path / "a.jsonl", [chat_row("a-1", "hello", max_tokens=3)]))
    batch = a.batches.create(
        input_file_id=file_a.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_done(a, batch.id)
    assert done.status == "completed" and [x["custom_id"] for x in read_lines(a, done.output_file_id)] == [
        "a-1"
    ]

    assert file_a.id in [f.id for f in a.files.list()] and batch.id in [x.id for x in a.batches.list()]
    assert b.files.list().data == [] and b.batches.list().data == []
    for call in (
        lambda: b.files.retrieve(file_a.id),
        lambda: b.files.content(file_a.id),
        lambda: b.files.delete(file_a.id),
        lambda: b.files.content(done.output_file_id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        b.batches.create(input_file_id=file_a.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert a.files.retrieve(file_a.id).id == file_a.id  # nothing b tried touched it

    tenant_dir = storage / "tenants" / "team-a"  # results, parts, records: all under the tenant
    assert (tenant_dir / "batches" / f"{batch.id}.json").exists()
    assert (tenant_dir / "files" / "data" / done.output_file_id).exists()
    assert not (storage / "batches").exists() and not (storage / "tenants" / "team-b" / "batches").exists()


def test_an_image_file_id_is_its_tenants_own(tenants, tmp_path):
    """A `vision` file of team-a, named in an image part: team-a's line finds it (and only the text model
    refuses it), team-b's line gets the 400 of a file that does not exist, found at validation."""
    service, key_a, key_b, _ = tenants
    a, b = service.client(api_key=key_a), service.client(api_key=key_b)
    image = a.files.create(file=("red.png", io.BytesIO(image_bytes())), purpose="vision")
    row = chat_row("look", "", max_tokens=3)
    row["body"]["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": image.id}}]
    errors = {}
    for name, client in (("a", a), ("b", b)):
        batch = client.batches.create(
            input_file_id=upload(client, write_jsonl(tmp_path / f"{name}.jsonl", [row])).id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        (line,) = read_lines(client, wait_done(client, batch.id).error_file_id)
        errors[name] = line["response"]["body"]["error"]
    param = "body.messages[0].content[0].image_url"
    assert (errors["a"]["code"], errors["a"]["param"]) == ("unsupported_parameter", param)
    assert (errors["b"]["code"], errors["b"]["param"]) == ("invalid_image_url", param)
    assert f"no file {image.id!r}" in errors["b"]["message"]


@pytest.mark.parametrize(
    "bad_id",
    [
        "../batches",
        "..%2F..%2Fkeys",
        "%2e%2e",
        "file-%00x",
        "a" * 5000,
        "files%2Fmeta%2Fx.json",
        "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    ],
    ids=["dotdot", "encoded-slash", "encoded-dots", "nul", "long", "key-path", "passwd"],
)
def test_ids_never_reach_storage_unchecked(tenants, bad_id):
    service, key_a, _, storage = tenants
    before = sorted(str(p) for p in storage.rglob("*"))
    for path in (f"/files/{bad_id}", f"/files/{bad_id}/content", f"/batches/{bad_id}"):
        status, body = _get(service.base_url + path, key_a)
        assert status in (404, 400), (path, status, body)
        assert isinstance(body, dict) and len(json.dumps(body)) < 2000, "errors quote ids in full"
    assert sorted(str(p) for p in storage.rglob("*")) == before


def test_a_filename_is_only_a_label(tenants, tmp_path):
    service, key_a, _, storage = tenants
    a = service.client(api_key=key_a)
    data = (json.dumps(chat_row("x", "hi")) + "\n").encode()
    made = a.files.create(file=("../../outside.jsonl", data), purpose="batch")
    assert a.files.content(made.id).content == data
    assert not list(Path(storage).parent.rglob("outside.jsonl"))
