"""API keys fail closed: a keys file that is broken, gone or unreadable means no key is valid; a change is
seen by content; `bulkgen keys revoke` removes keys from a running service's file.

A real service (uvicorn on 127.0.0.1, no workers needed) driven by the openai client.
"""

from __future__ import annotations

import logging
import os

import openai
import pytest
from click.testing import CliRunner

from bulkgen.api import create_app
from bulkgen.batch.service import BatchService
from bulkgen.cli import cli
from bulkgen.runtime.manager import BatchManager
from bulkgen.settings import Settings
from bulkgen.tenants import KeyRing, add_key, hash_key
from tests.support.service import MODEL, start_uvicorn


@pytest.fixture
def keyed(tmp_path):
    keys = tmp_path / "keys"
    key_a, key_b = add_key(keys, "team-a"), add_key(keys, "team-b")
    svc = BatchService(Settings(storage=str(tmp_path / "store"), models={MODEL: "unused"}))
    app = create_app(svc, BatchManager(svc), None, KeyRing.from_file(keys))  # the manager never starts
    server, thread, port = start_uvicorn(app)

    def ok(key: str) -> bool:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=30)
        try:
            client.files.list()
            return True
        except openai.AuthenticationError as err:
            assert err.status_code == 401 and err.body["code"] == "invalid_api_key"
            return False

    yield keys, key_a, key_b, ok
    server.should_exit = True
    thread.join(10)


def _errors(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "bulkgen.tenants" and r.levelno >= logging.ERROR
    ]


def test_a_broken_edit_that_revokes_a_key_accepts_no_key(keyed, caplog):
    keys, key_a, key_b, ok = keyed
    assert ok(key_a) and ok(key_b)
    caplog.set_level(logging.INFO, logger="bulkgen.tenants")
    keys.write_text(f"team-b {hash_key(key_b)}\nteam-c not-a-hash\n")  # revokes key_a, with one bad line
    assert not ok(key_a) and not ok(key_b) and not ok(key_b)
    assert len(_errors(caplog)) == 1, _errors(caplog)  # once per change, not per request
    assert f"{keys}:2: expected 'TENANT KEY_SHA256'" in _errors(caplog)[0]
    keys.write_text(f"team-b {hash_key(key_b)}\n")  # fixed: the edit takes effect
    assert ok(key_b) and not ok(key_a)


def test_a_deleted_or_unreadable_keys_file_accepts_no_key(keyed, caplog):
    keys, key_a, key_b, ok = keyed
    text = keys.read_text()
    caplog.set_level(logging.ERROR, logger="bulkgen.tenants")
    keys.unlink()
    assert not ok(key_a) and not ok(key_b)
    assert len(_errors(caplog)) == 1 and f"cannot read API keys file {keys}" in _errors(caplog)[0]
    keys.write_text(text)
    assert ok(key_a) and ok(key_b)
    keys.write_bytes(b"\xff\xfe team-a\n")
    assert not ok(key_a) and f"{keys}: not UTF-8 text" in _errors(caplog)[-1]


def test_an_edit_that_keeps_size_and_mtime_is_seen(keyed):
    keys, key_a, key_b, ok = keyed
    assert ok(key_a)
    before = keys.stat()
    key_c = "bg-replacement-key"
    keys.write_text(
        keys.read_text().replace(hash_key(key_a), hash_key(key_c))
    )  # same size: hashes are 64 hex
    os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert keys.stat().st_size == before.st_size and keys.stat().st_mtime_ns == before.st_mtime_ns
    assert not ok(key_a) and ok(key_c) and ok(key_b)


def test_keys_revoke_removes_keys_from_a_running_service(keyed):
    keys, key_a, key_b, ok = keyed
    key_a2 = add_key(keys, "team-a")
    keys.write_text("# operators' comment stays\n" + keys.read_text())
    listed = CliRunner().invoke(cli, ["keys", "list", "--file", str(keys)])
    labels = {f"sha256:{hash_key(k)[:16]}": k for k in (key_a, key_a2, key_b)}
    assert listed.exit_code == 0 and set(listed.stdout.splitlines()) == {
        f"{'team-b' if k == key_b else 'team-a'}\t{label}" for label, k in labels.items()
    }

    label_a = f"sha256:{hash_key(key_a)[:16]}"
    result = CliRunner().invoke(cli, ["keys", "revoke", label_a, "--file", str(keys)])
    assert result.exit_code == 0 and result.stdout == f"revoked team-a\t{label_a}\n", result.output
    assert not ok(key_a) and ok(key_a2) and ok(key_b)
    assert (
        keys.read_text().startswith("# operators' comment stays\n") and keys.stat().st_mode & 0o777 == 0o600
    )

    assert CliRunner().invoke(cli, ["keys", "revoke", key_a2, "--file", str(keys)]).exit_code == 0  # the key
    assert not ok(key_a2) and ok(key_b)
    assert (
        CliRunner().invoke(cli, ["keys", "revoke", "team-b", "--file", str(keys)]).exit_code == 0
    )  # a tenant
    assert not ok(key_b)

    for which, message in (("team-x", "no key matches 'team-x'"), ("sha256:12", "at least 8 hex digits")):
        bad = CliRunner().invoke(cli, ["keys", "revoke", which, "--file", str(keys)])
        assert bad.exit_code == 1 and message in bad.output and "Traceback" not in bad.output
