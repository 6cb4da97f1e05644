"""What tells the watcher to look: a poll timer (interval or cron) and S3 event notifications via SQS.

S3 sends one message per batch of events to the queue; the object keys in it are URL-encoded (a space
is '+', a '+' is '%2B'), and the first message after the notification is configured is an
`s3:TestEvent`, which is acknowledged and ignored. A message is deleted only once the watcher has made
its objects durable (claimed, and the batch record created) or found them finished; otherwise it
comes back after the queue's visibility timeout. The prefix is still polled now and then as a backstop
for missed events.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import unquote_plus

from bulkgen.watch.cron import Cron

log = logging.getLogger(__name__)

SQS_WAIT_S = 10  # long poll: one request per 10 s while the queue is empty
SQS_BATCH = 10  # the most messages SQS returns per receive


class PollTimer:
    """Due at start, then every `interval_s` seconds, or at each minute `cron` matches (UTC)."""

    def __init__(self, interval_s: float | None = None, cron: Cron | None = None) -> None:
        if (interval_s is None) == (cron is None):
            raise ValueError("give a poll interval or a cron schedule, not both or neither")
        if interval_s is not None and interval_s <= 0:
            raise ValueError(f"the poll interval must be positive, got {interval_s!r}")
        self.interval_s, self.cron = interval_s, cron
        self._next = time.time()

    def due(self) -> bool:
        now = time.time()
        if now < self._next:
            return False
        if self.cron is not None:
            self._next = self.cron.next_after(dt.datetime.fromtimestamp(now, dt.timezone.utc)).timestamp()
        else:
            self._next = now + self.interval_s
        return True

    def describe(self) -> str:
        return f"cron '{self.cron.expression}' (UTC)" if self.cron else f"every {self.interval_s:g} s"


@dataclass
class Message:
    """One SQS message: the keys it names under the watched prefix (decoded), and how to delete it."""

    receipt: str
    keys: list[str] = field(default_factory=list)
    test: bool = False


class SqsSource:
    """Receives in a thread (long poll) so the watcher's loop is never blocked by the queue."""

    def __init__(self, queue_url: str, bucket: str, root: str, endpoint_url: str | None = None) -> None:
        import boto3

        match = re.match(r"https://sqs\.([a-z0-9-]+)\.amazonaws\.com", queue_url)
        self.queue_url, self.bucket, self.root = queue_url, bucket, root.rstrip("/")
        self.client = boto3.client(
            "sqs", endpoint_url=endpoint_url, region_name=match.group(1) if match else None
        )
        self.inbox: queue.Queue[Message] = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, name="bulkgen-watch-sqs", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def messages(self, timeout: float) -> list[Message]:
        """Whatever arrived, waiting up to `timeout` seconds for the first."""
        out = []
        try:
            out.append(self.inbox.get(timeout=timeout))
            while True:
                out.append(self.inbox.get_nowait())
        except queue.Empty:
            return out

    def delete(self, message: Message) -> None:
        self.client.delete_message(QueueUrl=self.queue_url, ReceiptHandle=message.receipt)

    def _receive_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                reply = self.client.receive_message(
                    QueueUrl=self.queue_url, MaxNumberOfMessages=SQS_BATCH, WaitTimeSeconds=SQS_WAIT_S
                )
            except Exception as exc:  # the queue is unreachable for a moment: the backstop poll covers it
                log.warning("sqs %s: %s: %s", self.queue_url, type(exc).__name__, exc)
                self._stopped.wait(SQS_WAIT_S)
                continue
            for raw in reply.get("Messages", []):
                self.inbox.put(self.parse(raw))

    def parse(self, raw: dict) -> Message:
        message = Message(raw["ReceiptHandle"])
        try:
            body = json.loads(raw["Body"])
            if isinstance(body, dict) and isinstance(body.get("Message"), str):  # delivered through SNS
                body = json.loads(body["Message"])
        except (ValueError, TypeError):
            log.warning("sqs: message %s is not JSON; deleting it", raw.get("MessageId"))
            return message
        if not isinstance(body, dict):
            return message
        if body.get("Event") == "s3:TestEvent":
            message.test = True
            return message
        for record in body.get("Records") or []:
            if not isinstance(record, dict) or not str(record.get("eventName", "")).startswith(
                "ObjectCreated"
            ):
                continue
            s3 = record.get("s3") or {}
            if (s3.get("bucket") or {}).get("name") != self.bucket:
                continue
            key = unquote_plus((s3.get("object") or {}).get("key", ""))
            base = f"{self.root}/" if self.root else ""
            if key.startswith(base) and len(key) > len(base):
                message.keys.append(key[len(base) :])
        return message
