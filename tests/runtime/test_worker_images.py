"""The worker with a vision-language model, as plain Python: a range's image lines are read and decoded off
the engine thread and run with the processor's tokens; a bad image is its line's 400; and a line whose
preparation raises (here the processor, with a fault injected for one image size) hands its range back to
the driver instead of leaving the worker holding it forever."""

from __future__ import annotations

import gc
import io
import json
import threading

import numpy as np
import pytest

from bulkgen.batch.image_budget import ImageBudget
from bulkgen.engine.config import EngineConfig
from bulkgen.runtime import parts
from bulkgen.runtime.lineindex import index_file
from bulkgen.runtime.worker import EngineWorker
from bulkgen.runtime.workqueue import QueuedBatch, make_ranges
from bulkgen.store import LocalStore
from tests.runtime.test_worker import _drain
from tests.support.images import data_url, image_bytes, png_url
from tests.support.parts import stored_entries
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
def worker(vlm_path):
    path = vlm_path
    worker = EngineWorker(0, EngineConfig(max_num_seqs=8))
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
    entries = stored_entries(store, "batch_v")
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


def test_lines_decode_within_the_image_budget_and_give_it_back(worker, tmp_path):
    """A budget of two images' cost: six one-image lines and a two-image line all run, never more than the
    budget held, and every byte comes back once their requests ended and their tensors were freed."""
    store = LocalStore(tmp_path)
    url = png_url((400, 400), (1, 2, 3))
    budget = worker.image_budget = ImageBudget(2 * 400 * 400 * 16 + 4096)
    rows = [_image_row(f"r{i}", url) for i in range(6)]
    rows.append(_image_row("two", url))
    rows[-1]["body"]["messages"][0]["content"].insert(0, {"type": "image_url", "image_url": {"url": url}})
    job, ranges = _stored(store, "batch_b", rows)
    worker.assign(job, ranges)
    assert [o.error for o in _drain(worker, len(ranges))] == [None] * len(ranges)
    entries = stored_entries(store, "batch_b")
    assert sorted(entries) == list(range(1, 8)) and all(e["ok"] for e in entries.values())
    gc.collect()
    assert 0 < budget.peak <= budget.total and budget.used == 0


def test_a_line_waiting_for_image_memory_stops_with_its_batch(worker, tmp_path):
    store = LocalStore(tmp_path)
    budget = worker.image_budget = ImageBudget(400 * 400 * 16 + 4096)
    elsewhere = budget.acquire(budget.total)  # what other lines hold, never given back in this test
    job, ranges = _stored(store, "batch_c", [_image_row("waits", png_url((400, 400)))])
    assigning = threading.Thread(target=worker.assign, args=(job, ranges))
    assigning.start()
    assigning.join(1.0)
    assert assigning.is_alive()  # waiting for image memory
    worker.abort_batch("batch_c", None)
    assigning.join(5)
    assert not assigning.is_alive() and worker.poll("", 0)["held"] == 0
    assert budget.used == budget.total
    elsewhere.release()
    worker.forget("batch_c")
