"""LoRA adapters through the real service (uvicorn on 127.0.0.1, local Ray, the openai client): the bundled
model served with the four sample adapters (samples/lora/, written by bulkgen.lab.tiny_lora), one more on
another base, and an adapters file edited while the service runs.

`samples/lora.jsonl` names the base and four adapters on the same prompts; with a line naming an unknown
adapter and one naming the other base's adapter, those two are 400s naming `body.model` and the rest
complete, each adapter's greedy tokens differing from the base's and equal to the engine's for that
adapter alone.
"""

from __future__ import annotations

import json
import shutil
import uuid
from urllib.request import urlopen

import pytest

from bulkgen.lab.tiny_lora import SAMPLE_ADAPTERS, SAMPLES_DIR, save_random_adapter
from bulkgen.models.loras import parse_lora_specs
from bulkgen.models.registry import default_model_path
from tests.support.service import (
    SAMPLES,
    Service,
    random_model,
    read_lines,
    settings_for,
    upload,
    wait_done,
    write_jsonl,
)

BASE, OTHER = "bulkgen-tiny", "random"


@pytest.fixture(scope="module")
def bucket(s3_server):
    """The sample adapter `terse` under a moto bucket: an adapter served from the object store."""
    import boto3

    name = f"lora-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    s3.create_bucket(Bucket=name)
    for path in (SAMPLES_DIR / "terse").iterdir():
        s3.upload_file(str(path), name, f"adapters/terse/{path.name}")
    return name


@pytest.fixture(scope="module")
def service(tmp_path_factory, s3_server):
    root = tmp_path_factory.mktemp("lora")
    stranger = save_random_adapter(random_model(), root / "stranger", 5, 4, 8, ("q_proj",), base_name=OTHER)
    flags = [f"{name}={SAMPLES_DIR / name}" for name in SAMPLE_ADAPTERS if name != "pirate"]
    flags += [f"pirate={SAMPLES_DIR / 'pirate'}@{BASE}", f"stranger={stranger}"]
    adapters_file = root / "adapters.txt"
    adapters_file.write_text("")
    settings = settings_for(
        str(root / "storage"),
        models={BASE: default_model_path(), OTHER: str(random_model())},
        loras=parse_lora_specs(flags),
        lora_file=str(adapters_file),
        endpoint_url=s3_server,
    )
    service = Service(settings)
    service.adapters_file = adapters_file
    yield service
    service.stop()


@pytest.fixture(scope="module")
def client(service):
    return service.client()


def run(client, path):
    batch = client.batches.create(
        input_file_id=upload(client, path).id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_done(client, batch.id, timeout=300)
    assert batch.status == "completed", batch
    done = {line["custom_id"]: line["response"]["body"] for line in read_lines(client, batch.output_file_id)}
    failed = {line["custom_id"]: line["response"] for line in read_lines(client, batch.error_file_id)}
    return batch, done, failed


def test_models_lists_each_adapter_with_its_base(client):
    listed = {m.id: getattr(m, "parent", None) for m in client.models.list()}
    assert listed == {
        BASE: None,
        OTHER: None,
        **dict.fromkeys(SAMPLE_ADAPTERS, BASE),
        "stranger": OTHER,
    }
    model = client.models.retrieve("chatty")
    assert (model.id, model.object, model.parent) == ("chatty", "model", BASE)


def test_one_batch_mixes_the_base_and_four_adapters(service, client, tmp_path):
    rows = [json.loads(line) for line in (SAMPLES / "lora.jsonl").read_text().splitlines()]
    extra = [dict(rows[0], custom_id=cid, body=dict(rows[0]["body"], model=m)) for cid, m in BAD_LINES]
    batch, done, failed = run(client, write_jsonl(tmp_path / "in.jsonl", rows + extra))
    assert sorted(failed) == sorted(cid for cid, _ in BAD_LINES), list(failed.values())[:2]
    for response in failed.values():
        error = response["body"]["error"]
        assert response["status_code"] == 400 and error["param"] == "body.model", error
        assert error["code"] == "model_not_found" and "nor one of its adapters" in error["message"]
    assert len(done) == len(rows) and batch.request_counts.completed == len(rows)
    texts = {cid: body["choices"][0]["message"]["content"] for cid, body in done.items()}
    for row in rows:
        model, question = row["body"]["model"], row["custom_id"].split("-")[0]
        assert done[row["custom_id"]]["model"] == model  # each answer names the adapter that wrote it
        if model != BASE:
            assert texts[row["custom_id"]] != texts[f"{question}-{BASE}"], row["custom_id"]
    reference = alone([row for row in rows if row["body"]["model"] != BASE])
    assert {cid: texts[cid] for cid in reference} == reference  # the engine's text for that adapter alone
    adapters = batch.metrics["adapters"]
    assert {name: counts["requests"] for name, counts in adapters.items()} == dict.fromkeys(
        SAMPLE_ADAPTERS, 3
    )
    assert all(counts["output_tokens"] > 0 for counts in adapters.values())
    scraped = urlopen(service.base_url.removesuffix("/v1") + "/metrics").read().decode()
    for name, counts in adapters.items():
        assert f'bulkgen_adapter_requests{{adapter="{name}"}} 3.0' in scraped
        assert (
            f'bulkgen_adapter_tokens{{adapter="{name}",kind="output"}} {counts["output_tokens"]:.1f}'
            in scraped
        )


BAD_LINES = [("unknown", "no-such-adapter"), ("other-base", "stranger")]


def alone(rows: list[dict]) -> dict[str, str]:
    """Each row's text from an engine in this process running that row's adapter by itself,
    the row prepared as a worker prepares it (the line parser, the chat template, the context fit)."""
    from bulkgen.batch.prepare import fit_context, tokenize
    from bulkgen.batch.requests import parse_line
    from bulkgen.engine import Engine, SamplingParams

    engine = Engine.from_pretrained(default_model_path(), device="cpu")
    for name in SAMPLE_ADAPTERS:
        engine.add_lora(name, SAMPLES_DIR / name)
    texts = {}
    for model in sorted({row["body"]["model"] for row in rows}):
        for number, row in enumerate(rows, start=1):
            if row["body"]["model"] == model:
                request = parse_line(json.dumps(row), number, row["url"])
                ids = tokenize(request, engine.tokenizer)
                params = SamplingParams(**fit_context(request, len(ids), engine.max_model_len))
                engine.add_request(row["custom_id"], ids, params, lora=model)
        while engine.has_unfinished():
            texts.update({out.request_id: out.outputs[0].text for out in engine.step()})
    return texts


def test_adapters_added_to_the_file_are_served_without_a_restart(service, client, bucket, tmp_path):
    copy = shutil.copytree(SAMPLES_DIR / "terse", tmp_path / "terse-copy")
    service.adapters_file.write_text(f"terse-again={copy}\nterse-s3=s3://{bucket}/adapters/terse/\n")
    assert client.models.retrieve("terse-again").parent == BASE
    assert client.models.retrieve("terse-s3").parent == BASE  # its config read from the bucket
    rows = [json.loads(line) for line in (SAMPLES / "lora.jsonl").read_text().splitlines()][:2]
    assert rows[1]["body"]["model"] == "terse"
    for name in ("terse-again", "terse-s3"):
        rows.append(dict(rows[1], custom_id=name, body=dict(rows[1]["body"], model=name)))
    _, done, failed = run(client, write_jsonl(tmp_path / "in.jsonl", rows))
    assert not failed, failed
    text = {cid: body["choices"][0]["message"]["content"] for cid, body in done.items()}
    assert text["terse-again"] == text["terse-s3"] == text[rows[1]["custom_id"]] != text[rows[0]["custom_id"]]


def test_a_corrupt_adapter_fails_its_lines_as_model_not_loaded(service, client, tmp_path):
    """An adapter whose weights file is corrupt (a 2^40 header length): each line naming it is a 400
    `model_not_loaded` naming the adapter and its file (no server path), every other line of its ranges
    completes (a range that failed would be re-queued and halved, its lines ending as 500
    `engine_error`), and a second batch is refused the same way."""
    import struct

    corrupt = shutil.copytree(SAMPLES_DIR / "terse", tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    service.adapters_file.write_text(f"corrupt={corrupt}\n")
    assert client.models.retrieve("corrupt").parent == BASE  # its config is sound: served, until loaded
    rows = [json.loads(line) for line in (SAMPLES / "lora.jsonl").read_text().splitlines()]
    bad = [
        dict(row, custom_id=f"corrupt-{i}", body=dict(row["body"], model="corrupt"))
        for i, row in enumerate(rows[:3])
    ]
    mixed = [*rows[:5], bad[0], *rows[5:10], bad[1], *rows[10:], bad[2]]  # in both ranges of 16
    for attempt in range(2):
        batch, done, failed = run(client, write_jsonl(tmp_path / f"in-{attempt}.jsonl", mixed))
        assert sorted(done) == sorted(row["custom_id"] for row in rows)
        assert sorted(failed) == sorted(row["custom_id"] for row in bad)
        for response in failed.values():
            error = response["body"]["error"]
            assert response["status_code"] == 400 and error["code"] == "model_not_loaded", error
            assert error["param"] == "body.model" and "'corrupt'" in error["message"], error
            assert "adapter_model.safetensors: not a safetensors file" in error["message"], error
            assert str(tmp_path) not in error["message"], error
