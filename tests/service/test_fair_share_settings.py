"""Where fair share is configured and shown: batch priorities at create, tenant weights in the keys file
and in `--tenant-weight`, and the caller's share on the dashboard data."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from click.testing import CliRunner

from bulkgen.cli import cli
from bulkgen.settings import parse_tenant_weights
from bulkgen.store import LocalStore
from bulkgen.tenants import KeyRing, KeysFileError, add_key, parse_weights, revoke_keys
from tests.service.api_only import ApiOnly
from tests.support.service import chat_row, upload, write_jsonl


@pytest.fixture
def api(tmp_path):
    server = ApiOnly(LocalStore(tmp_path / "storage", fsync=False), tenant_weights={"default": 2.5})
    yield server
    server.stop()


def test_batch_priority_is_checked_at_create(api, tmp_path):
    client = api.client()
    file_id = upload(client, write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "hi")])).id
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"bulkgen_priority": "urgent"},
        )
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == "metadata.bulkgen_priority"
    assert "high, normal, low" in error["message"] and "'urgent'" in error["message"]
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"bulkgen_priority": "high"},
    )
    assert batch.status == "validating" and batch.metadata == {"bulkgen_priority": "high"}


def test_the_dashboard_shows_the_callers_weight_and_share(api):
    with urllib.request.urlopen(f"{api.root}/v1/dashboard/workers", timeout=30) as response:
        body = json.loads(response.read())
    assert body["fair_share"] == {"tenant": "default", "weight": 2.5, "share": 0.0}


def test_keys_file_weights_are_read_live_and_bad_ones_name_their_line(tmp_path):
    path = tmp_path / "keys"
    add_key(path, "team-a")
    ring = KeyRing.from_file(path)
    assert ring.weights() == {}
    with path.open("a") as f:
        f.write("team-a weight=3   # three times the default share\n")
    assert ring.weights() == {"team-a": 3.0}  # a running service sees the edit
    revoke_keys(path, "team-a")
    assert parse_weights(path, path.read_bytes()) == {"team-a": 3.0}  # rotation keeps the weight
    for line, message in [
        ("team-b weight=0", "weight of tenant 'team-b' must be a number > 0"),
        ("team-b weight=lots", "got 'lots'"),
        ("team-a weight=2", "a second, different weight for tenant 'team-a'"),
    ]:
        bad = tmp_path / "bad"
        bad.write_text(path.read_text() + line + "\n")
        with pytest.raises(KeysFileError, match=rf"bad:2: .*{message}"):
            parse_weights(bad, bad.read_bytes())


def test_tenant_weight_flags(tmp_path):
    assert parse_tenant_weights(["analytics=3", "batch-team=0.5"]) == {"analytics": 3.0, "batch-team": 0.5}
    rows = write_jsonl(tmp_path / "in.jsonl", [chat_row("a", "hi")])
    result = CliRunner().invoke(
        cli,
        [
            "run",
            str(rows),
            "-o",
            str(tmp_path / "out"),
            "--storage",
            str(tmp_path / "s"),
            "--tenant-weight",
            "analytics",
        ],
    )
    assert result.exit_code == 2 and "expected TENANT=W" in result.output
