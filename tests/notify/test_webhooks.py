"""Completion webhooks without a service: event shape, signature, retries, give-up, never blocking.

Every event is checked by a real HTTP receiver with the official `openai` package's webhooks.unwrap."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from click.testing import CliRunner
from openai.types.webhooks import BatchCompletedWebhookEvent, BatchExpiredWebhookEvent

from bulkgen.batch.batchrecord import BatchRecord, new_batch_record
from bulkgen.batch.schema import BatchStatus
from bulkgen.cli import cli
from bulkgen.notify.webhooks import WebhookNotifier, event_id, parse_secret
from tests.support.receiver import SECRET, Receiver, SilentReceiver
from tests.support.wait import wait_until

FAST = {"first_wait_s": 0.02, "max_wait_s": 0.1}


def _record(
    batch_id: str = "batch_abc123", status: str = "completed", at: int = 1_790_000_000
) -> BatchRecord:
    record = new_batch_record("file-abc", "/v1/completions", "24h", None, batch_id=batch_id)
    record.status = BatchStatus(status)  # as a run leaves it (the notifier reads, never moves, statuses)
    setattr(record, f"{status}_at", at)
    return record


@pytest.fixture
def receiver():
    made: list = []

    def make(cls=Receiver, *args):
        made.append(cls(*args))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_event_is_openais_shape_and_verifies_with_the_openai_package(receiver):
    r = receiver()
    notifier = WebhookNotifier(r.url, SECRET)
    notifier(_record(status="completed"))
    notifier(_record(status="expired", at=1_790_000_100))
    first, second = r.wait_events(2)
    notifier.close()
    assert isinstance(first, BatchCompletedWebhookEvent) and isinstance(second, BatchExpiredWebhookEvent)
    assert first.data.id == second.data.id == "batch_abc123"
    assert (first.object, first.created_at, second.created_at) == ("event", 1_790_000_000, 1_790_000_100)
    assert first.id == event_id("batch_abc123", "completed") != second.id
    body, headers = r.requests[0]
    assert headers["webhook-id"] == first.id and headers["content-type"] == "application/json"
    assert headers["webhook-signature"].startswith("v1,")
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 30
    assert set(__import__("json").loads(body)) == {"id", "object", "type", "created_at", "data"}
    assert notifier.delivered == 2 and not r.rejected


def test_a_wrong_secret_fails_verification(receiver):
    r = receiver(Receiver, [], "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldY")  # the receiver holds another
    notifier = WebhookNotifier(r.url, SECRET, attempts=1)
    notifier(_record())
    notifier.close()
    assert len(r.requests) == 1 and not r.events and "InvalidWebhookSignatureError" in r.rejected[0]


def test_5xx_and_429_are_retried_and_the_event_is_delivered_once(receiver):
    r = receiver(Receiver, [500, 500])
    notifier = WebhookNotifier(r.url, SECRET, **FAST)
    notifier(_record(status="failed"))
    (event,) = r.wait_events(1)
    notifier.close()  # its sender thread has ended: every request it would make has arrived
    assert event.type == "batch.failed" and len(r.requests) == 3 and len(r.events) == 1
    assert len({body for body, _ in r.requests}) == 1  # the same event each time
    assert len({h["webhook-id"] for _, h in r.requests}) == 1  # receivers de-duplicate on it
    assert notifier.delivered == 1 and notifier.dropped == 0

    throttled = receiver(Receiver, [429, 503])
    notifier = WebhookNotifier(throttled.url, SECRET, **FAST)
    notifier(_record(status="cancelled"))
    assert throttled.wait_events(1)[0].type == "batch.cancelled" and len(throttled.requests) == 3
    notifier.close()


def test_a_4xx_answer_is_not_retried_and_is_logged_in_one_line(receiver, caplog):
    r = receiver(Receiver, [410])
    notifier = WebhookNotifier(r.url, SECRET, **FAST)
    with caplog.at_level(logging.ERROR, logger="bulkgen.notify.webhooks"):
        notifier(_record())
        notifier.close()
    assert len(r.requests) == 1 and notifier.dropped == 1
    (line,) = [rec.getMessage() for rec in caplog.records]
    assert "\n" not in line and "batch_abc123" in line and "HTTP 410" in line and r.url in line


def test_an_unreachable_receiver_is_retried_then_logged(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    notifier = WebhookNotifier(f"http://127.0.0.1:{port}/x", SECRET, attempts=3, **FAST)
    with caplog.at_level(logging.ERROR, logger="bulkgen.notify.webhooks"):
        notifier(_record())
        wait_until(lambda: notifier.dropped, 10, "the event to be given up on")
        notifier.close()
    assert notifier.dropped == 1 and notifier.delivered == 0
    (line,) = [rec.getMessage() for rec in caplog.records]
    assert "not delivered" in line and "Connection" in line


def test_a_receiver_that_never_answers_never_blocks_the_caller(receiver):
    silent = receiver(SilentReceiver)
    notifier = WebhookNotifier(silent.url, SECRET, timeout_s=0.3, attempts=2, queue_size=2, **FAST)
    started = time.monotonic()
    for i in range(5):  # the sender is stuck on the first; two wait in the queue; the rest are dropped
        notifier(_record(batch_id=f"batch_{i}"))
    assert time.monotonic() - started < 0.1
    wait_until(lambda: notifier.dropped >= 5, 10, "all five events to be given up on")
    notifier.close()
    assert notifier.dropped == 5 and notifier.delivered == 0


def test_only_final_statuses_make_events(receiver):
    r = receiver()
    notifier = WebhookNotifier(r.url, SECRET)
    notifier(_record(status="in_progress"))
    notifier(_record(status="cancelled"))
    (event,) = r.wait_events(1)
    notifier.close()
    assert event.type == "batch.cancelled" and len(r.requests) == 1


@pytest.mark.parametrize(
    "secret, message",
    [
        ("s3cret", "must look like whsec_"),
        ("whsec_not*base64", "valid base64"),
        ("whsec_c2hvcnQ=", "at least 16"),
    ],
)
def test_bad_secrets_are_refused_clearly(secret, message):
    with pytest.raises(ValueError, match=message):
        parse_secret(secret)


def test_serve_refuses_a_webhook_without_a_secret(monkeypatch):
    monkeypatch.delenv("BULKGEN_WEBHOOK_SECRET", raising=False)
    result = CliRunner().invoke(cli, ["serve", "--webhook", "http://127.0.0.1:9/hooks"])
    assert result.exit_code == 2 and "--webhook needs --webhook-secret" in result.output
    result = CliRunner().invoke(
        cli, ["serve"], env={"BULKGEN_WEBHOOK_URL": "ftp://example/x", "BULKGEN_WEBHOOK_SECRET": SECRET}
    )
    assert result.exit_code == 2 and "http(s)://host" in result.output


def test_undelivered_events_survive_the_process_and_are_sent_by_the_next(receiver, tmp_path):
    """With the service's store, an event still being retried when its process stops is kept under
    webhooks/pending/ and sent by the next notifier on that storage; delivered ones are forgotten."""
    from bulkgen.store import open_store

    store = open_store(str(tmp_path / "storage"))
    store.create()
    silent = receiver(SilentReceiver)
    first = WebhookNotifier(silent.url, SECRET, store=store, timeout_s=0.2, first_wait_s=30)
    retry_wait = threading.Event()
    wait_between_tries = first._sleep  # observed, not replaced: the notifier waits exactly as it would

    def observed_wait(seconds: float) -> None:
        retry_wait.set()
        wait_between_tries(seconds)

    first._sleep = observed_wait
    first(_record(batch_id="batch_one", status="completed"))
    first(_record(batch_id="batch_two", status="cancelled"))
    assert len(list(store.list("webhooks/pending/"))) == 2  # kept before the first try
    assert retry_wait.wait(30)  # the first try timed out; it now waits 30 s to retry
    first.close(wait_s=0.2)  # stopped mid-wait, as a service that is shut down or dies
    assert first.delivered == 0 and len(list(store.list("webhooks/pending/"))) == 2

    r = receiver()
    second = WebhookNotifier(r.url, SECRET, store=store)
    events = r.wait_events(2)
    second.close()
    assert {(e.data.id, e.type) for e in events} == {
        ("batch_one", "batch.completed"),
        ("batch_two", "batch.cancelled"),
    }
    assert {e.id for e in events} == {event_id("batch_one", "completed"), event_id("batch_two", "cancelled")}
    assert list(store.list("webhooks/pending/")) == [] and second.delivered == 2
