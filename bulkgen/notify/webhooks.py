"""Completion webhooks: one signed event POSTed when a batch ends, as the hosted OpenAI API sends them.

The body is OpenAI's webhook event, `{"id": "evt_…", "object": "event", "type": "batch.completed",
"created_at": <the batch's completed_at/failed_at/…>, "data": {"id": "batch_…"}}`, one of
batch.completed, batch.failed, batch.expired and batch.cancelled. It is signed per the Standard Webhooks
spec exactly as the hosted API signs it: headers `webhook-id`, `webhook-timestamp` and `webhook-signature:
v1,<base64 HMAC-SHA256 of "{webhook-id}.{timestamp}.{body}">`, keyed by the base64-decoded part of a
`whsec_…` secret, so `openai.OpenAI(webhook_secret=…).webhooks.unwrap(body, headers)` verifies it.

Delivery is at least once. The event id (and webhook-id) is derived from the batch id and its final
status, so a resent event carries the same id and receivers de-duplicate on it. One background thread
sends from a bounded queue, so a slow or dead receiver never holds a batch up: network errors, 5xx and 429
are retried with exponential backoff (tenacity); any other answer, or the last failed try, is logged in
one line and the event is dropped. Given the service's store, each event is also kept in it
(`layout.webhook_pending`) until it is delivered or dropped, and a notifier that starts sends what an
earlier process left there (one that died, was stopped mid-retry, or had a full queue).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from bulkgen import __version__
from bulkgen.batch.batchrecord import BatchRecord
from bulkgen.batch.schema import TERMINAL_STATUSES
from bulkgen.store import NotFound, Store, layout

log = logging.getLogger(__name__)

EVENT_TYPES = {status: f"batch.{status.value}" for status in TERMINAL_STATUSES}
SECRET_PREFIX = "whsec_"
PENDING_PREFIX = layout.WEBHOOKS_PENDING


class Retryable(Exception):
    """A try that may succeed later: the receiver was unreachable, answered 5xx or 429."""


class Closing(Exception):
    """close() cut a retry wait short: the event stays pending for the next start."""


def parse_secret(secret: str) -> bytes:
    """The HMAC key inside a `whsec_<base64>` secret; ValueError says what is wrong with it."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"the webhook secret must look like {SECRET_PREFIX}<base64> (as OpenAI's do)")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except binascii.Error:
        raise ValueError(f"the webhook secret is not {SECRET_PREFIX} followed by valid base64") from None
    if len(key) < 16:
        raise ValueError(f"the webhook secret holds {len(key)} bytes; use at least 16 (24-64 is usual)")
    return key


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"the webhook URL must be http(s)://host/...; got {url!r}")
    return url


def event_id(batch_id: str, status: str) -> str:
    """Stable per batch end: a resent event is recognisably the same event."""
    return "evt_" + hashlib.sha256(f"{batch_id}:{status}".encode()).hexdigest()[:32]


def batch_event(record: BatchRecord) -> dict:
    """The webhook event for a batch record in a final status."""
    status = record.status
    return {
        "id": event_id(record.id, status),
        "object": "event",
        "type": EVENT_TYPES[status],
        "created_at": int(getattr(record, f"{status}_at") or time.time()),
        "data": {"id": record.id},
    }


def signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


class WebhookNotifier:
    """Call it with a batch's final record (it is BatchService's `on_batch_end` hook); it never blocks on
    the receiver. With `store`, events survive the process (see the module docstring)."""

    def __init__(
        self,
        url: str,
        secret: str,
        *,
        store: Store | None = None,
        attempts: int = 8,
        first_wait_s: float = 1.0,
        max_wait_s: float = 60.0,
        timeout_s: float = 10.0,
        queue_size: int = 1000,
    ) -> None:
        self.url = check_url(url)
        self._key = parse_secret(secret)
        self.store = store
        self.attempts, self.first_wait_s, self.max_wait_s, self.timeout_s = (
            attempts,
            first_wait_s,
            max_wait_s,
            timeout_s,
        )
        self._queue: queue.Queue[dict | None] = queue.Queue(maxsize=queue_size)
        self._closed = threading.Event()
        self.delivered = 0
        self.dropped = 0
        if store is not None:
            try:
                self._resend_pending()
            except Exception as exc:  # the storage is down now: what is pending waits for the next start
                log.error("webhooks: events pending under %s not resent: %s", PENDING_PREFIX, exc)
        self._thread = threading.Thread(target=self._loop, name="bulkgen-webhooks", daemon=True)
        self._thread.start()

    def __call__(self, record: BatchRecord) -> None:
        if record.status not in EVENT_TYPES:
            return
        event = batch_event(record)
        if self.store is not None:
            try:
                self.store.write_bytes(_pending_key(event), json.dumps(event).encode())
            except Exception as exc:  # storage down for a moment: the event is still sent from memory
                log.error(
                    "webhook %s for %s not kept under %s: %s",
                    event["type"],
                    record.id,
                    PENDING_PREFIX,
                    exc,
                )
        self._enqueue(event)

    def close(self, wait_s: float = 5.0) -> None:
        """Send what is queued for up to `wait_s`, then stop (retry waits are cut short; with a store,
        what is left stays pending for the next start)."""
        try:
            self._queue.put(None, timeout=wait_s)
        except queue.Full:
            pass
        self._thread.join(wait_s)
        self._closed.set()
        self._thread.join(1.0)

    def _enqueue(self, event: dict) -> bool:
        try:
            self._queue.put_nowait(event)
            return True
        except queue.Full:
            self.dropped += 1
            kept = " (kept pending)" if self.store is not None else ""
            log.error(
                "webhook %s for %s not queued: %d events already wait%s",
                event["type"],
                event["data"]["id"],
                self._queue.maxsize,
                kept,
            )
            return False

    def _resend_pending(self) -> None:
        for key in self.store.list(PENDING_PREFIX):
            try:
                event = json.loads(self.store.read_bytes(key))
            except (NotFound, ValueError):  # delivered meanwhile by another replica, or not ours
                continue
            if not self._enqueue(event):
                return

    def _loop(self) -> None:
        while (event := self._queue.get()) is not None and not self._closed.is_set():
            try:
                self.deliver(event)
            except Closing:
                return
            except Exception as exc:  # the last retry failed, or an answer that retrying cannot change
                self.dropped += 1
                log.error(
                    "webhook %s %s for %s to %s not delivered: %s",
                    event["type"],
                    event["id"],
                    event["data"]["id"],
                    self.url,
                    exc,
                )
            self._forget(event)

    def _forget(self, event: dict) -> None:
        if self.store is not None:
            try:
                self.store.delete(_pending_key(event))
            except Exception as exc:  # it will be sent once more at the next start: harmless
                log.warning("webhook %s: pending copy not removed: %s", event["id"], exc)

    def deliver(self, event: dict) -> None:
        body = json.dumps(event, separators=(",", ":")).encode()
        retrying = Retrying(
            retry=retry_if_exception_type(Retryable),
            wait=wait_exponential(multiplier=self.first_wait_s, max=self.max_wait_s),
            stop=stop_after_attempt(self.attempts),
            sleep=self._sleep,
            reraise=True,
        )
        retrying(self._post, event["id"], body)
        self.delivered += 1

    def _sleep(self, seconds: float) -> None:
        if self._closed.wait(seconds):
            raise Closing()

    def _post(self, msg_id: str, body: bytes) -> None:
        timestamp = int(time.time())  # signed afresh per try: a late retry stays inside the receiver's window
        headers = {
            "content-type": "application/json",
            "user-agent": f"bulkgen/{__version__}",
            "webhook-id": msg_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(self._key, msg_id, timestamp, body),
        }
        request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            if exc.code >= 500 or exc.code == 429:
                raise Retryable(f"HTTP {exc.code}") from None
            raise RuntimeError(f"HTTP {exc.code} (not retried)") from None
        except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
            raise Retryable(f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}") from None


def _pending_key(event: dict) -> str:
    return layout.webhook_pending(event["id"])
