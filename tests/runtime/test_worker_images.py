"""The worker with a vision-language model, as plain Python: a range's image lines are read and decoded off
the engine thread and run with the processor's tokens; a bad image is its line's 400; and a line whose
preparation raises (here the processor, with a fault injected for one image size) hands its range back to
the driver instead of leaving the worker holding it forever."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from bulkgen.lab.tiny_vision import build_tiny_vlm
from bulkgen.runtime import parts
from bulkgen.runtime.lineindex import index_file
from bulkgen.runtime.worker import EngineWorker
from bulkgen.runtime.workqueue import QueuedBatch, make_ranges
from bulkgen.store import LocalStore
from tests.runtime.test_worker import _drain
from tests.support.images import data_url, image_bytes, png_url
from tests.support.service import chat_row

VLM = "tiny-vlm"
CRASH_SIZE = (5, 7)


def _image_row(custom_id: str, url: str) -> dict:
    row = chat_row(custom_id, "", max_tokens=3, model=VLM)
    row["body"]["messages"][0]["content"] = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is it?"},
    ]
    return row


def _stored(store, batch_id: str, rows: list[dict]):
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    key = f"files/data/{batch_id}-in"
    store.write_bytes(key, data)
    index = index_file(io.BytesIO(data), "/v1/chat/completions")
    job = QueuedBatch(batch_id, key, "/v1/chat/completions", VLM, "unused", 0.0, store.open_args())
    return job, [r.bounds for r in make_ranges(job, index, np.ones(len(index), bool), 8)]


class _Faulty:
    """The model's processor, raising for one image size (a processor's own refusal of an odd image)."""

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, *args, images=None, **kwargs):
        if any(image.size == CRASH_SIZE for image in images or []):
            raise RuntimeError("the processor cannot take this image")
        return self.processor(*args, images=images, **kwargs)

    def __getattr__(self, name):
        return getattr(self.processor, name)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", "llava", seed=3)
    worker = EngineWorker(0, {"max_num_seqs": 8})
    worker.load(VLM, str(path))
    worker.engine.vision.processor = _Faulty(worker.engine.vision.processor)
    return worker


def test_image_lines_run_and_a_bad_image_is_its_lines_400(worker, tmp_path):
    store = LocalStore(tmp_path)
    png = image_bytes("PNG", (40, 40), (9, 9, 9))
    rows = [
        _image_row("image", png_url((30, 20))),
        _image_row("truncated", data_url(png[: len(png) // 2])),
        chat_row("text", "Hello", max_tokens=3, model=VLM),
    ]
    job, ranges = _stored(store, "batch_v", rows)
    worker.assign(job, ranges)
    (outcome,) = _drain(worker, 1)
    assert outcome.error is None
    entries = {}
    for key, _, _ in parts.iter_parts(store, "batch_v"):
        entries.update({e["line"]: e for e in map(json.loads, store.iter_lines(key))})
    assert entries[1]["ok"] and entries[3]["ok"] and entries[1]["usage"][1] == 3
    assert entries[1]["usage"][0] > entries[3]["usage"][0]  # the image's placeholder tokens are prompt tokens
    error = entries[2]["envelope"]["response"]["body"]["error"]
    assert (error["code"], error["param"]) == ("invalid_image", "body.messages[0].content[0].image_url")


def test_a_line_whose_preparation_raises_hands_its_range_back(worker, tmp_path):
    store = LocalStore(tmp_path)
    rows = [_image_row("fine", png_url()), _image_row("odd", png_url(CRASH_SIZE))]
    job, ranges = _stored(store, "batch_w", rows)
    worker.assign(job, ranges)
    (outcome,) = _drain(worker, 1)
    assert outcome.error == "RuntimeError: the processor cannot take this image" and not outcome.storage_down
    assert worker.poll("", 0)["held"] == 0  # nothing left counted as being prepared
    assert list(parts.iter_parts(store, "batch_w")) == []  # the driver reruns it (halved, to find the line)
