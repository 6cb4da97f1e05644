"""Completion webhooks from a real service: every way a batch ends sends its event, once, after the final
record is stored, and a receiver that never answers does not hold a batch up."""

from __future__ import annotations

import json
import time

import pytest

from bulkgen.batch.batchrecord import BatchRecord
from tests.support.held_engine import HOLD
from tests.support.receiver import SECRET, Receiver, SilentReceiver
from tests.support.service import Service, chat_row, settings_for, upload, wait_done, wait_for, write_jsonl
from tests.support.wait import wait_until


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    """A service whose on_batch_end hands each final record to the notifiers the test put in `hooks`."""
    hooks: list = []
    ended: list[dict] = []

    def on_batch_end(record: dict) -> None:
        ended.append(record)
        for hook in hooks:
            hook(record)

    service = Service(settings_for(str(tmp_path_factory.mktemp("hooked"))), on_batch_end=on_batch_end)
    yield service, hooks, ended
    service.stop()


@pytest.fixture
def notifier(hooked):
    from bulkgen.notify.webhooks import WebhookNotifier

    _, hooks, _ = hooked
    made = []

    def make(receiver, **kwargs):
        made.append((WebhookNotifier(receiver.url, SECRET, **kwargs), receiver))
        hooks.append(made[-1][0])
        return made[-1][0]

    yield make
    hooks.clear()
    for n, receiver in made:
        receiver.close()
        n.close(wait_s=1.0)


def _create(client, tmp_path, name: str, rows: list) -> object:
    file_id = upload(client, write_jsonl(tmp_path / f"{name}.jsonl", rows)).id
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def _wait_event(receiver: Receiver, batch_id: str, timeout: float = 30.0) -> None:
    wait_until(
        lambda: any(e.data.id == batch_id for e in receiver.events),
        timeout,
        f"an event for {batch_id}",
        details=lambda: str(receiver.requests),
    )


def _events_for(receiver: Receiver, batch_id: str) -> list:
    return [e for e in receiver.events if e.data.id == batch_id]


def test_every_ending_sends_one_verified_event(hooked, notifier, tmp_path, engine_gate):
    service, _, ended = hooked
    receiver = Receiver()
    hook = notifier(receiver)
    client = service.client()

    done = wait_done(client, _create(client, tmp_path, "ok", [chat_row("a", "hi", max_tokens=2)]).id)
    failed = wait_done(
        client, _create(client, tmp_path, "bad", [chat_row("a", "hi", model="no-such-model")]).id
    )
    assert failed.status == "failed"  # at validation: it never runs
    cancelled = _create(client, tmp_path, "cancel", [chat_row("long", f"{HOLD} story", max_tokens=64)])
    expired = _create(client, tmp_path, "expire", [chat_row("long", f"{HOLD} story", max_tokens=64)])
    engine_gate.wait_held()
    wait_for(client, cancelled.id, lambda b: b.status == "in_progress")
    client.batches.cancel(cancelled.id)

    def expire_now(record: BatchRecord) -> BatchRecord:
        record.expires_at = int(time.time())
        return record

    service.svc.batches.update(expired.id, expire_now)
    batches = {
        b.id: b for b in (done, failed, wait_done(client, cancelled.id), wait_done(client, expired.id))
    }
    assert [b.status for b in batches.values()] == ["completed", "failed", "cancelled", "expired"]

    for batch_id in batches:
        _wait_event(receiver, batch_id)
    hook.close()  # its sender thread has ended: every request it would make for these events has arrived
    for batch_id, batch in batches.items():
        (event,) = _events_for(receiver, batch_id)
        assert event.type == f"batch.{batch.status}"
        assert event.created_at == getattr(batch, f"{batch.status}_at")
    assert not receiver.rejected and len(receiver.requests) == 4
    assert sorted(r.id for r in ended) == sorted(batches)  # the hook ran once per batch end
    for record in ended:  # with the final record, results and all, already stored
        assert service.svc.batches.get(record.id).status == record.status
    completed = next(r for r in ended if r.status == "completed")
    assert completed.output_file_id and completed.request_counts.completed == 1
    assert json.loads(receiver.requests[0][0])["object"] == "event"


def test_retried_after_two_500s_and_delivered_once(hooked, notifier, tmp_path):
    service, _, _ = hooked
    receiver = Receiver([500, 500])
    hook = notifier(receiver, first_wait_s=0.1, max_wait_s=0.5)
    client = service.client()
    batch = wait_done(client, _create(client, tmp_path, "retry", [chat_row("a", "hi", max_tokens=2)]).id)
    _wait_event(receiver, batch.id)
    hook.close()  # nothing more can arrive
    (event,) = _events_for(receiver, batch.id)
    assert event.type == "batch.completed" and len(receiver.requests) == 3
    assert len({h["webhook-id"] for _, h in receiver.requests}) == 1


def test_a_receiver_that_never_answers_does_not_delay_batches(hooked, notifier, tmp_path):
    service, _, _ = hooked
    silent = SilentReceiver()
    stuck = notifier(silent, timeout_s=120)  # each try would hang for two minutes
    client = service.client()
    started = time.monotonic()
    first = wait_done(
        client, _create(client, tmp_path, "s1", [chat_row("a", "hi", max_tokens=2)]).id, timeout=60
    )
    second = wait_done(
        client, _create(client, tmp_path, "s2", [chat_row("a", "yo", max_tokens=2)]).id, timeout=60
    )
    assert first.status == second.status == "completed"
    assert time.monotonic() - started < 60  # far less than one webhook try
    assert stuck.delivered == 0 and stuck.dropped == 0  # still on its first try; the second event waits
