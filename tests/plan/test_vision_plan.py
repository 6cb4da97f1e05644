"""A vision model's encoder in the profile and the plan (lab/tiny_vision.py's LLaVA): `bulkgen profile` measures
its cost per call and per image, `bulkgen plan` adds it to the time of a file's images as a line of its own,
a profile without it says the time leaves it out, and a text model's plan has no such line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from bulkgen.cli import cli
from bulkgen.plan import profile as profiles
from bulkgen.plan.encoder import fit_encoder
from bulkgen.plan.timed import Encoder, EngineLimits, batch_seconds
from bulkgen.store import open_store
from tests.support.images import VLM, data_url, image_bytes, image_tokens
from tests.support.service import write_jsonl

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
LINES = 6


@pytest.fixture(scope="module")
def vlm_profile(vlm_path):
    """The real profile of the tiny LLaVA, on a smaller grid (the rule, not the figures)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(profiles, "BATCH_SIZES", (1, 16))
        patch.setattr(profiles, "CHURN_ROUNDS", 1)
        return profiles.measure_here(VLM, str(vlm_path))


def _row(i: int, with_image: bool) -> dict:
    text = {"type": "text", "text": f"Describe picture number {i} in a few words."}
    image = {
        "type": "image_url",
        "image_url": {"url": data_url(image_bytes("PNG", (32, 32), (40 * i, 90, 10)))},
    }
    body = {
        "model": VLM,
        "messages": [{"role": "user", "content": [image, text] if with_image else [text]}],
        "max_tokens": 12,
        "temperature": 0,
    }
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _plan(tmp_path: Path, name: str, profile: profiles.Profile, rows: list, model: str, *text: bool):
    """`bulkgen plan --json` (and, with `text`, its printed form) of `rows` against `profile` stored."""
    storage = tmp_path / f"storage-{name}"
    storage.mkdir()
    profiles.save(open_store(str(storage)), profile)
    path = write_jsonl(tmp_path / f"{name}.jsonl", rows) if rows else SAMPLES / "chat.jsonl"
    args = [
        "plan",
        str(path),
        "--storage",
        str(storage),
        "--gpu",
        "cpu",
        *(["--model", model] if model else []),
    ]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output), (CliRunner().invoke(cli, args).output if text else "")


def test_the_profile_of_a_vision_model_holds_its_encoder_cost(vlm_profile):
    assert vlm_profile.encoder_call_s is not None
    assert vlm_profile.encoder_call_s + vlm_profile.per_image_s > 0
    # LLaVA's processor resizes every image to one size: tokens per image never vary, so no token term
    assert vlm_profile.per_image_token_s == 0
    assert profiles.Profile.from_json(vlm_profile.to_json()) == vlm_profile


def test_plan_adds_the_encoder_to_the_time_of_a_files_images(vlm_profile, vlm_path, tmp_path):
    """The measured step costs, with encoder costs set here: the tiny encoder's own (a few ms for the file)
    would vanish in the plan's 10 ms rounding on a quiet machine."""
    p = dataclasses.replace(vlm_profile, encoder_call_s=0.05, per_image_s=0.2)
    spec = f"{VLM}={vlm_path}"
    images = [_row(i, True) for i in range(LINES)]
    with_images, text = _plan(tmp_path, "images", p, images, spec, True)
    alone, _ = _plan(tmp_path, "text", p, [_row(i, False) for i in range(LINES)], spec)
    from transformers import AutoProcessor

    per_image = image_tokens(AutoProcessor.from_pretrained(vlm_path, local_files_only=True))
    encoder = with_images["encoder"]
    assert (encoder["images"], encoder["image_tokens"]) == (LINES, LINES * per_image)
    assert alone["encoder"]["images"] == 0 and alone["encoder"]["seconds"] == 0
    # each step that admits images pays one call and their per-image cost: one step for all, at most one each
    low, high = p.encoder_call_s + LINES * p.per_image_s, LINES * (p.encoder_call_s + p.per_image_s)
    assert low - 0.01 <= encoder["seconds"] <= high + 0.01 and encoder["seconds"] > 0
    expected = with_images["estimated_seconds"]["expected"]
    assert expected - alone["estimated_seconds"]["expected"] >= encoder["seconds"] - 0.01
    # the same file with a profile that has no encoder cost: the time is less by exactly the encoder term
    unmeasured = dataclasses.replace(p, encoder_call_s=None, per_image_s=0.0)
    without, untold = _plan(tmp_path, "unmeasured", unmeasured, images, spec, True)
    assert without["encoder"]["seconds"] is None
    assert abs(without["estimated_seconds"]["expected"] - (expected - encoder["seconds"])) <= 0.011
    assert f"of the time above: {LINES} images ({LINES * per_image} image tokens) to encode" in text
    assert "not in the time above (the profile has no encoder cost: `bulkgen profile` again)" in untold


def test_a_text_models_plan_has_no_encoder_line(tmp_path):
    stored = profiles.Profile("bulkgen-tiny", "cpu", 0.004, 1e-4, 8e-5, 1e-6, 64, 2048, 512, 16, 0.4)
    plan, text = _plan(tmp_path, "chat", stored, [], "", True)
    assert plan["encoder"] is None
    assert "time on 1 worker" in text and "encoder" not in text


def test_a_repeated_image_the_prefix_cache_holds_is_not_encoded_again(vlm_profile, vlm_path, tmp_path):
    """The engine encodes a request's images only when its prefill reaches them; a prompt whose cached prefix
    covers them never does."""
    first = _row(1, True)
    again = json.loads(json.dumps(first)) | {"custom_id": "again"}
    plan, _ = _plan(tmp_path, "again", vlm_profile, [first, again, _row(2, True)], f"{VLM}={vlm_path}")
    assert plan["images"] == 3 and plan["encoder"]["images"] == 2


def test_the_simulator_pays_the_encoder_in_the_steps_that_admit_images():
    one_step = EngineLimits(max_num_seqs=8, max_num_batched_tokens=1024)
    one_each = EngineLimits(max_num_seqs=1, max_num_batched_tokens=1024)
    work = ([10, 10, 10], [1, 1, 1], lambda *_: 1.0)
    encoder = Encoder([0.5, 0.25, 0.0], call_s=0.1)
    for limits, calls in ((one_step, 1), (one_each, 2)):
        plain = batch_seconds(*work, limits)
        assert batch_seconds(*work, limits, encoder=encoder) == pytest.approx(plain + 0.75 + 0.1 * calls)


def test_the_encoder_fit_recovers_its_costs_and_leaves_out_a_token_term_it_cannot_tell():
    call, per_image, per_token = 2e-3, 1e-3, 4e-6
    rows = [(n, n * t, call + per_image * n + per_token * n * t) for t in (64, 256) for n in (1, 2, 4)]
    fitted = fit_encoder(rows)
    assert dataclasses.astuple(fitted) == pytest.approx((call, per_image, per_token), rel=1e-6)
    fixed = fit_encoder([(n, 4 * n, call + 3e-3 * n) for n in (1, 2, 4)])
    assert dataclasses.astuple(fixed) == pytest.approx((call, 3e-3, 0.0), rel=1e-6)
