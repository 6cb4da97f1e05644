"""LoRA adapters scoped to tenants, through the real service (uvicorn on 127.0.0.1, local Ray, the openai client,
two tenants with keys): an adapter with `tenants=` is served to those tenants alone, to the others it does not
exist (the same `model_not_found` as a name nothing serves, and /v1/models lists only what the caller may run);
an unscoped adapter stays global; and no client-facing message names a server path (the adapter's folder).
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from bulkgen.lab.tiny_lora import SAMPLES_DIR
from bulkgen.models.loras import parse_lora_specs
from bulkgen.models.registry import default_model_path
from bulkgen.tenants import KeyRing, add_key
from tests.support.service import Service, read_lines, settings_for, upload, wait_done, write_jsonl

BASE = "bulkgen-tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`terse` for everyone, `chatty` for team-a (a flag), `formal` for team-b (the adapters file), and `dora` for
    team-a: a folder whose config the engine refuses (DoRA) when a worker loads it."""
    root = tmp_path_factory.mktemp("lora-tenants")
    dora = shutil.copytree(SAMPLES_DIR / "terse", root / "adapters" / "dora-folder")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    adapters_file = root / "adapters.txt"
    adapters_file.write_text(f"formal={SAMPLES_DIR / 'formal'} tenants=team-b\ndora={dora} tenants=team-a\n")
    keys = root / "keys"
    key_a, key_b = add_key(keys, "team-a"), add_key(keys, "team-b")
    flags = [f"terse={SAMPLES_DIR / 'terse'}", f"chatty={SAMPLES_DIR / 'chatty'} tenants=team-a"]
    settings = settings_for(
        str(root / "storage"),
        models={BASE: default_model_path()},
        loras=parse_lora_specs(flags),
        lora_file=str(adapters_file),
    )
    service = Service(settings, keyring=KeyRing.from_file(keys))
    yield service, service.client(key_a), service.client(key_b), root
    service.stop()


def _row(custom_id: str, model: str) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _run(client, path, rows):
    batch = client.batches.create(
        input_file_id=upload(client, write_jsonl(path, rows)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch = wait_done(client, batch.id, timeout=300)
    assert batch.status == "completed", batch
    done = {line["custom_id"] for line in read_lines(client, batch.output_file_id)}
    failed = {
        line["custom_id"]: line["response"]["body"]["error"]
        for line in read_lines(client, batch.error_file_id)
    }
    return done, failed


def test_each_tenant_lists_and_retrieves_only_the_adapters_it_may_run(served):
    _, team_a, team_b, _ = served
    assert {m.id for m in team_a.models.list()} == {BASE, "terse", "chatty", "dora"}
    assert {m.id for m in team_b.models.list()} == {BASE, "terse", "formal"}
    assert team_a.models.retrieve("chatty").parent == BASE
    for name in (
        "chatty",
        "no-such-adapter",
    ):  # another tenant's adapter is answered as one that does not exist
        with pytest.raises(openai.NotFoundError) as caught:
            team_b.models.retrieve(name)
        assert caught.value.body["code"] == "model_not_found"
        assert caught.value.body["message"] == f"The model {name!r} does not exist"


def test_another_tenants_adapter_is_model_not_found_naming_only_the_callers_adapters(served, tmp_path):
    _, _, team_b, _ = served
    rows = [_row("base", BASE), _row("terse", "terse"), _row("formal", "formal")]
    rows += [_row("chatty", "chatty"), _row("nope", "nope")]
    done, failed = _run(team_b, tmp_path / "b.jsonl", rows)
    assert done == {"base", "terse", "formal"} and set(failed) == {"chatty", "nope"}
    chatty, nope = failed["chatty"], failed["nope"]
    assert (
        (chatty["code"], chatty["param"])
        == (nope["code"], nope["param"])
        == ("model_not_found", "body.model")
    )
    assert chatty["message"].replace("chatty", "X") == nope["message"].replace("nope", "X")  # the same answer
    assert "(formal, terse)" in nope["message"]  # the caller's adapters, never another tenant's
    for hidden in ("dora",):
        assert hidden not in nope["message"] and hidden not in chatty["message"]


def test_the_scoped_tenant_runs_its_adapter_and_a_refused_one_names_no_server_path(served, tmp_path):
    service, team_a, _, root = served
    rows = [_row("chatty", "chatty"), _row("terse", "terse"), _row("dora", "dora"), _row("formal", "formal")]
    done, failed = _run(team_a, tmp_path / "a.jsonl", rows)
    assert done == {"chatty", "terse"} and set(failed) == {"dora", "formal"}
    assert failed["formal"]["code"] == "model_not_found"
    refused = failed["dora"]
    assert (refused["code"], refused["param"]) == ("model_not_loaded", "body.model")
    assert "DoRA" in refused["message"] and "'dora'" in refused["message"]
    for server_path in (str(root), "dora-folder", str(service.svc.settings.storage)):
        assert server_path not in refused["message"]
