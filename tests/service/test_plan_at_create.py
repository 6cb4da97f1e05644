"""The estimate a batch carries from create on, and `--refuse-infeasible`, on the session's real service.

The profile here is test input: step costs written as a `bulkgen profile` would store them, with prompt
tokens so slow (10 s each) that a ~1,000-token prompt cannot fit a 1 h window while a one-word prompt fits
with room to spare. Prompt cost, not output length: how long answers run is learnt from the session's
earlier batches of MODEL (bulkgen/plan/lengths.py), so output-bound figures would depend on test order.
The profile is removed afterwards so the other tests' batches carry no estimate.
"""

from __future__ import annotations

from dataclasses import replace

import openai
import pytest

from bulkgen.plan import profile as profiles
from bulkgen.plan.calibrate import LIMITS
from tests.support.images import VLM, png_url
from tests.support.service import MODEL, chat_row, upload, validated, wait_done, write_jsonl

LONG = " ".join(["word"] * 900)  # about a thousand prompt tokens
# 10 s a prompt token: LONG cannot fit a 1 h window even when the session's earlier batches of MODEL scale
# the profile down by the most the runtime factor allows (LIMITS[0], bulkgen/plan/calibrate.py); "x" fits
PER_TOKEN_S = 10.0


@pytest.fixture
def slow_profile(service):
    store = service.svc.root
    key = profiles.save(
        store, profiles.Profile(MODEL, "cpu", 0.01, 0.0, PER_TOKEN_S, 0.0, 64, 1024, 4096, 16, 1.0, 0.0, 0.05)
    )
    yield
    store.delete(key)
    service.svc.settings.refuse_infeasible = False


def test_batch_carries_its_estimate_and_a_window_warning(service, slow_profile, tmp_path):
    client = service.client()
    held = LONG
    f = upload(client, write_jsonl(tmp_path / "long.jsonl", [chat_row("long-0", held, max_tokens=8)]))
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    batch = validated(client, batch.id)
    try:  # its work is not the point; a one-request batch may end before the cancel reaches it
        client.batches.cancel(batch.id)
    except openai.ConflictError:
        pass
    # a one-request batch may finish before the first poll sees it in_progress; it keeps its estimate
    assert batch.status in ("in_progress", "finalizing", "completed")
    metrics = batch.model_extra["metrics"]  # there in the same write that made the batch in_progress
    seconds = metrics["estimated_seconds"]
    # a token is at least a character; earlier batches of MODEL may scale the profile by up to LIMITS[1]
    assert 3600 < seconds["low"] <= seconds["expected"] <= PER_TOKEN_S * len(held) * LIMITS[1] + 1
    assert metrics["estimated_completion_at"] >= batch.created_at + seconds["expected"] - 1
    (warning,) = batch.errors.data
    assert warning.code == "completion_window_infeasible_warning" and warning.param == "completion_window"
    assert "longer than its completion window of 1h" in warning.message
    done = wait_done(client, batch.id)
    assert done.status in ("cancelled", "completed")
    assert done.model_extra["metrics"]["estimated_seconds"] == seconds  # the estimate outlives the run
    assert [e.code for e in done.errors.data] == ["completion_window_infeasible_warning"]


def test_refuse_infeasible_answers_400_at_create(service, slow_profile, tmp_path):
    service.svc.settings.refuse_infeasible = True
    client = service.client()
    f = upload(client, write_jsonl(tmp_path / "long.jsonl", [chat_row("long-0", LONG, max_tokens=8)]))
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    error = caught.value.body
    assert error["code"] == "completion_window_infeasible" and error["param"] == "completion_window"
    assert "even alone" in error["message"]
    fits = upload(client, write_jsonl(tmp_path / "short.jsonl", [chat_row("short-0", "x", max_tokens=4)]))
    batch = client.batches.create(
        input_file_id=fits.id, endpoint="/v1/chat/completions", completion_window="1h"
    )
    assert batch.status == "in_progress" and batch.errors is None  # validated at create
    assert wait_done(client, batch.id).status == "completed"


def test_the_estimate_of_image_lines_includes_the_vision_encoder(service, vlm_client, tmp_path):
    """The profile's encoder cost per image is part of the estimate at create: 1,000 s an image here, so two
    image lines cost at least 2,000 s (scaled by no less than LIMITS[0]); the same file against the same
    steps without an encoder cost, a few seconds."""
    store = service.svc.root
    steps = profiles.Profile(VLM, "cpu", 0.01, 0.0, 0.0, 0.0, 64, 1024, 4096, 16, 1.0)
    image = {"type": "image_url", "image_url": {"url": png_url((20, 20))}}
    content = [image, {"type": "text", "text": "Describe it."}]
    rows = [chat_row(f"img-{i}", content, 4, model=VLM) for i in range(2)]
    path = write_jsonl(tmp_path / "images.jsonl", rows)
    estimates = []
    for profile in (replace(steps, encoder_call_s=0.0, per_image_s=1000.0), steps):
        key = profiles.save(store, profile)
        try:
            batch = vlm_client.batches.create(
                input_file_id=upload(vlm_client, path).id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
            )
            estimates.append(validated(vlm_client, batch.id).model_extra["metrics"]["estimated_seconds"])
            assert wait_done(vlm_client, batch.id).status == "completed"
        finally:
            store.delete(key)
    with_encoder, without = estimates
    assert with_encoder["expected"] >= 2 * 1000.0 * LIMITS[0]
    assert without["expected"] < 100
