"""A model or adapter refused at load fails its lines as `model_not_loaded` (400) and is remembered: its ranges
finish (nothing goes back to the queue to be halved), the other lines run, and later lines and batches do
not load it again (EngineWorker as plain Python, no Ray; the dispatcher's side with a stand-in actor)."""

from __future__ import annotations

import io
import json
import types

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

import bulkgen.runtime.worker as worker_module
from bulkgen.engine.config import EngineConfig
from bulkgen.engine.features.lora import WEIGHTS_FILE
from bulkgen.engine.model.checkpoint_checks import CheckpointError
from bulkgen.lab.quantized import write_block_fp8
from bulkgen.lab.tiny_lora import save_random_adapter
from bulkgen.runtime.lineindex import index_file
from bulkgen.runtime.worker import EngineWorker
from bulkgen.runtime.workqueue import QueuedBatch, make_ranges
from bulkgen.store import LocalStore
from tests.runtime.test_worker import _drain, _lines
from tests.support.service import MODEL, completion_row, random_model


def _batch(store, batch_id: str, rows: list[dict], loras: dict[str, str], **fields):
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    key = f"files/data/{batch_id}-in"
    store.write_bytes(key, data)
    index = index_file(io.BytesIO(data), "/v1/completions")
    job = QueuedBatch(
        batch_id, key, "/v1/completions", MODEL, "unused", 0.0, store.open_args(), loras=loras, **fields
    )
    return job, [r.bounds for r in make_ranges(job, index, np.ones(len(index), bool), 4)]


def test_a_corrupt_adapter_fails_its_lines_once_and_never_its_ranges(tmp_path, monkeypatch):
    (tmp_path / "store").mkdir()
    store = LocalStore(tmp_path / "store")
    good = save_random_adapter(random_model(), tmp_path / "good", 3, 4, 8, ("q_proj",), base_name=MODEL)
    broken = save_random_adapter(random_model(), tmp_path / "broken", 4, 4, 8, ("q_proj",), base_name=MODEL)
    (broken / WEIGHTS_FILE).write_bytes(b"\x07\x06\x05\x04\x03\x02\x01\x00 not a safetensors file" * 4)
    fetched = []
    real_fetch = worker_module.fetch_folder
    monkeypatch.setattr(
        worker_module, "fetch_folder", lambda path, *a, **k: fetched.append(path) or real_fetch(path, *a, **k)
    )
    worker = EngineWorker(0, EngineConfig(max_num_seqs=8))
    worker.load(MODEL, str(random_model()))
    loras = {"good": str(good), "broken": str(broken)}
    models = [MODEL, "good", "broken"]

    def run(batch_id: str) -> dict[int, dict]:
        rows = [completion_row(f"r{i}", f"hello {i}", max_tokens=2, model=models[i % 3]) for i in range(12)]
        job, ranges = _batch(store, batch_id, rows, loras)
        worker.assign(job, ranges)
        outcomes = _drain(worker, len(ranges))
        assert len(outcomes) == len(ranges)
        # no range handed back to the driver as failed: nothing is re-queued, retried or halved
        assert [o.error for o in outcomes] == [None] * len(ranges)
        assert sum(o.tally.failed for o in outcomes) == 4 and sum(o.tally.completed for o in outcomes) == 8
        return _lines(store, batch_id)

    for batch_id in ("batch_1", "batch_2"):
        lines = run(batch_id)
        assert sorted(lines) == list(range(1, 13))
        for line, entry in lines.items():
            if models[(line - 1) % 3] != "broken":
                assert entry["ok"], entry
                continue
            response = entry["envelope"]["response"]
            error = response["body"]["error"]
            assert response["status_code"] == 400 and error["code"] == "model_not_loaded", error
            assert error["param"] == "body.model"
            assert "'broken'" in error["message"] and WEIGHTS_FILE in error["message"], error
            assert "not a safetensors file" in error["message"] and str(tmp_path) not in error["message"]
    # loaded (and refused) once over both batches; the good adapter once too
    assert fetched.count(str(broken)) == 1 and fetched.count(str(good)) == 1

    # the folder rewritten in place is a new version: tried again, and now served
    save_random_adapter(random_model(), broken, 4, 4, 8, ("q_proj",), base_name=MODEL)
    rows = [completion_row("fixed", "hello", max_tokens=2, model="broken")]
    job, ranges = _batch(store, "batch_3", rows, loras)
    worker.assign(job, ranges)
    _drain(worker, len(ranges))
    assert _lines(store, "batch_3")[1]["ok"] and fetched.count(str(broken)) == 2


def test_a_broken_checkpoint_is_refused_at_load_and_remembered(tmp_path, monkeypatch):
    checkpoint = write_block_fp8(random_model(), tmp_path / "fp8", block=32)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight_scale_inv"].fill_(float("nan"))
    save_file(tensors, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    worker = EngineWorker(0, EngineConfig(max_num_seqs=8))
    worker.load(MODEL, str(random_model()))
    loads = []
    real = worker._on_engine_thread
    monkeypatch.setattr(worker, "_on_engine_thread", lambda fn: loads.append(fn) or real(fn))
    for _ in range(2):
        with pytest.raises(CheckpointError, match=r"model\.safetensors: .*up_proj\.weight_scale_inv .*nan"):
            worker.load("fp8", str(checkpoint))
    assert len(loads) == 2  # the first call: the old engine's close, then the refused load; none after


def test_the_dispatcher_refuses_the_lines_of_a_model_refused_at_load(monkeypatch):
    """A CheckpointError from the worker's load: each range's lines are model_not_loaded, the batch goes on
    (no fatal) and no range goes back to the queue."""
    import ray

    from bulkgen.runtime import dispatch

    refused = CheckpointError("checkpoint 'fp8': model.safetensors: x.weight_scale_inv has non-finite values")
    error = ray.exceptions.RayTaskError("load", "traceback", refused).as_instanceof_cause()

    def get(*args, **kwargs):
        raise error

    monkeypatch.setattr(dispatch.ray, "get", get)

    class Runner:
        def __init__(self):
            self.refused, self.fatals = [], []

        def refuse_range(self, r, code, message, param=None):
            self.refused.append((r, code, message, param))

        def fatal(self, message):
            self.fatals.append(message)

    class Handle:
        class load:
            @staticmethod
            def remote(*args):
                return None

    class Queue:
        def put_back(self, ranges, count=True):
            raise AssertionError("a refused model's ranges must not go back to the queue")

    runner = Runner()

    class Pool:  # the load is waited for in slices of the poll deadline (dispatch._until_loaded)
        settings = types.SimpleNamespace(poll_deadline_s=1.0)

    dispatcher = dispatch.Dispatcher(
        pool=Pool(), queue=Queue(), endpoint_url=None, runner_of=lambda _: runner, owner=""
    )
    job = QueuedBatch("b", "k", "/v1/completions", "fp8", "/models/fp8", 0.0, {})
    ranges = _ranges(job)
    assert dispatcher._load(0, Handle(), ranges) is False
    assert runner.fatals == [] and [r for r, *_ in runner.refused] == ranges
    assert {(code, param) for _, code, _, param in runner.refused} == {("model_not_loaded", "body.model")}
    assert "x.weight_scale_inv has non-finite values" in runner.refused[0][2]


def _ranges(job):
    data = "".join(json.dumps(completion_row(f"r{i}", "hi")) + "\n" for i in range(8)).encode()
    index = index_file(io.BytesIO(data), "/v1/completions")
    return make_ranges(job, index, np.ones(len(index), bool), 4)
