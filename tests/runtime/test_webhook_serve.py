"""`bulkgen serve --webhook URL --webhook-secret whsec_...` as a real subprocess: its batches' events reach
a real receiver, which verifies them with the `openai` package."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from tests.support.receiver import SECRET, Receiver

pytestmark = pytest.mark.slow


def test_serve_sends_signed_events_for_completed_and_failed_batches(serve_process, tmp_path):
    receiver = Receiver()
    storage = str(tmp_path / "storage")
    try:
        service = serve_process(storage, "--webhook", receiver.url, "--webhook-secret", SECRET)
        client: OpenAI = service.client()
        good = {
            "custom_id": "a",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "bulkgen-tiny", "prompt": "The list is", "max_tokens": 2},
        }
        bad = {**good, "body": {**good["body"], "model": "no-such-model"}}
        ids = []
        for rows in ([good], [bad]):
            data = "".join(json.dumps(r) + "\n" for r in rows).encode()
            file = client.files.create(file=("in.jsonl", data), purpose="batch")
            ids.append(
                client.batches.create(
                    input_file_id=file.id, endpoint="/v1/completions", completion_window="24h"
                ).id
            )
        events = {e.data.id: e for e in receiver.wait_events(2, timeout=120)}
        assert events[ids[0]].type == "batch.completed" and events[ids[1]].type == "batch.failed"
        assert client.batches.retrieve(ids[0]).status == "completed"
        assert not receiver.rejected and len(receiver.requests) == 2
        pending = tmp_path / "storage" / "webhooks" / "pending"
        assert pending.is_dir() and not list(
            pending.iterdir()
        )  # kept while in flight, forgotten once delivered
    finally:
        receiver.close()
