"""A broken checkpoint through the real service (uvicorn on 127.0.0.1, local Ray, the openai client): a block-FP8
copy of the tiny model with a NaN in one scale, served beside the sound model. Its batches complete with
every line a 400 `model_not_loaded` naming the file and tensor (it used to load and answer every line 200
with garbage), a second batch is refused the same way, and the sound model's batch still runs."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file

from bulkgen.lab.quantized import write_block_fp8
from tests.support.service import (
    Service,
    completion_row,
    random_model,
    read_lines,
    settings_for,
    upload,
    wait_done,
    write_jsonl,
)

SCALE = "model.layers.0.mlp.up_proj.weight_scale_inv"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    broken = write_block_fp8(random_model(), root / "fp8", block=32)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors[SCALE].view(-1)[0] = float("nan")
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    settings = settings_for(
        str(root / "storage"), models={"sound": str(random_model()), "broken": str(broken)}
    )
    service = Service(settings)
    yield service
    service.stop()


def _run(client, path):
    batch = client.batches.create(
        input_file_id=upload(client, path).id, endpoint="/v1/completions", completion_window="24h"
    )
    batch = wait_done(client, batch.id, timeout=300)
    assert batch.status == "completed", batch
    return batch, read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)


def test_a_broken_checkpoints_lines_are_model_not_loaded(service, tmp_path):
    client = service.client()
    rows = [completion_row(f"b{i}", f"hello {i}", max_tokens=2, model="broken") for i in range(20)]
    for attempt in range(2):
        batch, done, failed = _run(client, write_jsonl(tmp_path / f"broken-{attempt}.jsonl", rows))
        assert done == [] and len(failed) == len(rows) and batch.request_counts.failed == len(rows)
        for line in failed:
            response = line["response"]
            error = response["body"]["error"]
            assert response["status_code"] == 400 and error["code"] == "model_not_loaded", error
            assert f"model.safetensors: {SCALE} has non-finite values (nan" in error["message"], error
            assert str(tmp_path) not in error["message"] and "\n" not in error["message"]
    sound = [completion_row(f"s{i}", f"hello {i}", max_tokens=2, model="sound") for i in range(3)]
    _, done, failed = _run(client, write_jsonl(tmp_path / "sound.jsonl", sound))
    assert len(done) == 3 and failed == []
