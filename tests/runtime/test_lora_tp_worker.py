"""LoRA adapters on a tensor-parallel worker, through the real service (uvicorn on 127.0.0.1, local Ray, the
openai client), configured by the serve command's own flags: `--tensor-parallel bulkgen-tiny=2` and
`--lora NAME=PATH` for the four sample adapters. `samples/lora.jsonl` (the base and the four adapters on
the same prompts, one batch) completes on the two-rank group with each adapter row's text equal to a
single-process engine's for that adapter alone, and different from the base's."""

from __future__ import annotations

import json
from urllib.request import urlopen

import pytest

from bulkgen.cli.server_cmds import serve
from bulkgen.lab.tiny_lora import SAMPLE_ADAPTERS, SAMPLES_DIR
from bulkgen.models.registry import default_model_path
from bulkgen.settings_flags import from_flags
from tests.service.test_lora_service import BASE, alone, run
from tests.support.service import SAMPLES, Service


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    flags = ["--storage", str(tmp_path_factory.mktemp("lora-tp") / "store")]
    flags += ["--model", f"{BASE}={default_model_path()}", "--tensor-parallel", f"{BASE}=2"]
    flags += ["--cpu-workers", "1", "--range-size", "16"]
    for name in SAMPLE_ADAPTERS:
        flags += ["--lora", f"{name}={SAMPLES_DIR / name}"]
    service = Service(from_flags(serve.make_context("serve", flags).params))
    yield service
    service.stop()


def test_a_two_rank_worker_serves_mixed_adapters(service, tmp_path):
    client = service.client()
    batch, done, failed = run(client, SAMPLES / "lora.jsonl")
    rows = [json.loads(line) for line in (SAMPLES / "lora.jsonl").read_text().splitlines()]
    assert not failed and len(done) == len(rows) == batch.request_counts.completed
    assert {row["body"]["model"] for row in rows} == {BASE, *SAMPLE_ADAPTERS}
    texts = {cid: body["choices"][0]["message"]["content"] for cid, body in done.items()}
    reference = alone([row for row in rows if row["body"]["model"] != BASE])
    assert {cid: texts[cid] for cid in reference} == reference
    for cid in reference:  # and each adapter's text is its own, not the base's
        assert texts[cid] != texts[f"{cid.split('-')[0]}-{BASE}"], cid
    workers = json.loads(urlopen(f"{service.base_url}/dashboard/workers", timeout=30).read())["data"]
    assert [r["rank"] for r in workers[0]["ranks"]] == [0, 1]  # the batch ran on a two-rank group
