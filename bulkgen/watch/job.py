"""Job definitions: what `bulkgen watch --job jobs/NAME.yaml` watches, and how it runs what it finds.

    input: s3://bucket/inbox/summaries/      # or a local folder
    output: s3://bucket/outbox/summaries/
    model: bulkgen-tiny                      # body.model where a line has none
    endpoint: /v1/chat/completions           # url where a line has none (default: the first line's url)
    completion_window: 24h
    interval: 30                             # seconds between polls, or:
    schedule: "*/5 * * * *"                  # a 5-field cron expression (UTC)
    sqs_queue_url: https://sqs...            # S3 event notifications (the prefix is still polled, slowly)
    defaults: {temperature: 0.7, max_tokens: 64}   # set in each request body where the line sets none
    output_format: parquet                   # or jsonl (default)
    webhook: https://example.com/hooks       # signed batch.* events (secret: --webhook-secret / env only)
    storage: ...                             # service storage, served models and LoRA adapters, as the
    models: [NAME=PATH]                      #   CLI's --storage / --model / --lora (the command line wins)
    loras: [NAME=PATH@BASE]
    tensor_parallel: 2                       # ranks per worker, as --tensor-parallel N, or per model
                                             #   as --tensor-parallel NAME=N: {big: 2, small: 1}

Everything is checked when the job loads, with errors that name the file and the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from bulkgen.batch import endpoints
from bulkgen.batch.requests import CHAT, LineError, parse_line
from bulkgen.batch.resultfiles import FORMATS
from bulkgen.batch.schema import ENDPOINTS, InvalidRequest, parse_completion_window
from bulkgen.settings import Flag, setting
from bulkgen.watch.cron import Cron, CronError

DEFAULT_INTERVAL_S = 10.0  # polling alone
DEFAULT_BACKSTOP_S = 300.0  # the slow poll beside SQS events
DEFAULT_CLAIM_TTL_S = 60.0


class JobError(ValueError):
    """A job definition (or option) that cannot run, in one line."""


@dataclass
class Job:
    """A job's fields; those with a `Flag` are `bulkgen watch`'s options too (bulkgen.cli.settings_options
    .job_flags), which override the job file's value when given. `storage`, `models` and `webhook` are the
    service's flags (settings and webhook options), used when the command line leaves them out."""

    input: str | None = setting(
        None, flag=Flag("--input", "Prefix to watch: a folder or s3://bucket/inbox/.")
    )
    output: str | None = setting(
        None, flag=Flag("--output", "Where results go: a folder or s3://bucket/outbox/.")
    )
    name: str | None = None
    model: str | None = None
    endpoint: str | None = setting(
        None,
        flag=Flag(
            "--endpoint", "Batch endpoint; default: the url of each file's first line.", choices=ENDPOINTS
        ),
    )
    completion_window: str = setting(
        "24h", flag=Flag("--completion-window", "Completion window of the batches (default 24h).")
    )
    interval: float | None = setting(
        None,
        flag=Flag(
            "--interval", "Seconds between polls (default 10; 300 beside --sqs-queue-url).", type=float
        ),
    )
    schedule: str | None = setting(
        None,
        flag=Flag(
            "--schedule", "Poll at these times instead: a 5-field cron expression (UTC), e.g. '*/5 * * * *'."
        ),
    )
    sqs_queue_url: str | None = setting(
        None,
        flag=Flag("--sqs-queue-url", "Also react to S3 event notifications delivered to this SQS queue."),
    )
    defaults: dict[str, Any] = field(default_factory=dict)
    output_format: str = setting(
        "jsonl", flag=Flag("--output-format", "Result format (default jsonl).", choices=FORMATS)
    )
    claim_ttl: float = setting(
        DEFAULT_CLAIM_TTL_S,
        flag=Flag(
            "--claim-ttl",
            "Seconds before another watcher takes over an object whose watcher stopped (default 60).",
            type=float,
        ),
    )
    storage: str | None = None
    models: list[str] = field(default_factory=list)
    loras: list[str] = field(default_factory=list)
    tensor_parallel: int | dict[str, int] | None = None  # ranks per worker (N), or per model ({NAME: N})
    webhook: str | None = None

    @classmethod
    def load(cls, path: str | Path) -> Job:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise JobError(f"{path}: cannot read the job: {exc}".replace("\n", " ")) from None
        if not isinstance(data, dict):
            raise JobError(f"{path}: a job is a YAML mapping of fields such as input, output, model")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise JobError(
                f"{path}: unknown field(s) {', '.join(map(str, unknown))}; known: {', '.join(sorted(known))}"
            )
        job = cls(**{"name": Path(path).stem, **data})
        job.check(str(path))
        return job

    def override(self, **values: Any) -> Job:
        """Command-line values (those given, not None) replace the job's."""
        for name, value in values.items():
            if value is not None:
                setattr(self, name, value)
        if values.get("schedule") is not None and values.get("interval") is None:
            self.interval = None  # a schedule on the command line replaces the job's interval, and back
        if values.get("interval") is not None and values.get("schedule") is None:
            self.schedule = None
        return self

    def check(self, where: str = "job") -> Job:
        if not self.input or not isinstance(self.input, str):
            raise JobError(f"{where}: input (a folder or s3://bucket/prefix/) is required")
        if not self.output or not isinstance(self.output, str):
            raise JobError(f"{where}: output (a folder or s3://bucket/prefix/) is required")
        if self.output_format not in FORMATS:
            raise JobError(
                f"{where}: output_format must be one of {', '.join(FORMATS)}; got {self.output_format!r}"
            )
        if self.endpoint is not None and self.endpoint not in ENDPOINTS:
            raise JobError(f"{where}: endpoint must be one of {', '.join(ENDPOINTS)}; got {self.endpoint!r}")
        try:
            parse_completion_window(self.completion_window)
        except InvalidRequest as exc:
            raise JobError(f"{where}: {exc}") from None
        if self.interval is not None and self.schedule is not None:
            raise JobError(f"{where}: give interval or schedule, not both")
        if self.interval is not None and (not isinstance(self.interval, int | float) or self.interval <= 0):
            raise JobError(f"{where}: interval must be a positive number of seconds; got {self.interval!r}")
        if not isinstance(self.claim_ttl, int | float) or self.claim_ttl < 1:
            raise JobError(f"{where}: claim_ttl must be at least 1 second; got {self.claim_ttl!r}")
        if self.schedule is not None:
            try:
                Cron(self.schedule)
            except CronError as exc:
                raise JobError(f"{where}: {exc}") from None
        for name, form in (("models", "NAME=PATH"), ("loras", "NAME=PATH[@BASE]")):
            listed = getattr(self, name)
            if not isinstance(listed, list) or not all(isinstance(m, str) for m in listed):
                raise JobError(f"{where}: {name} must be a list of {form} strings")
        self._check_ranks(where)
        self._check_defaults(where)
        return self

    def _check_ranks(self, where: str) -> None:
        tp = self.tensor_parallel
        counts = tp.values() if isinstance(tp, dict) else [] if tp is None else [tp]
        if isinstance(tp, dict) and not all(isinstance(name, str) and name for name in tp):
            raise JobError(f"{where}: tensor_parallel's keys must be served model names; got {list(tp)!r}")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts):
            raise JobError(
                f"{where}: tensor_parallel must be a positive whole number of ranks, or a mapping "
                f"{{NAME: N}} of them; got {tp!r}"
            )

    def rank_flags(self) -> tuple[str, ...]:
        """`tensor_parallel` as the values of --tensor-parallel (N, or NAME=N per model)."""
        tp = self.tensor_parallel
        if isinstance(tp, dict):
            return tuple(f"{name}={n}" for name, n in tp.items())
        return () if tp is None else (str(tp),)

    def _check_defaults(self, where: str) -> None:
        """Defaults must be what a request body may hold: the request parser says so, naming the field."""
        if not isinstance(self.defaults, dict):
            raise JobError(
                f"{where}: defaults must be a mapping such as {{temperature: 0.7, max_tokens: 64}}"
            )
        for name in ("model", "messages", "prompt", "input"):
            if name in self.defaults:
                raise JobError(
                    f"{where}: defaults.{name} is not a sampling parameter"
                    + ("; use the job's model field" if name == "model" else "")
                )
        endpoint = self.endpoint or CHAT
        body = {"model": self.model or "m", **self.defaults}
        body.update(endpoints.ENDPOINTS[endpoint].sample_input)
        try:
            parse_line(_json({"custom_id": "defaults", "url": endpoint, "body": body}), 1, endpoint)
        except LineError as exc:
            raise JobError(f"{where}: defaults: {exc.message}") from None

    def body_defaults(self) -> dict[str, Any]:
        """What is set in each request body where the line has none (the model too)."""
        return {**({"model": self.model} if self.model else {}), **self.defaults}

    def poll_interval(self) -> float | None:
        if self.schedule is not None:
            return None
        return self.interval or (DEFAULT_BACKSTOP_S if self.sqs_queue_url else DEFAULT_INTERVAL_S)


def _json(obj: dict) -> bytes:
    import json

    return json.dumps(obj).encode()
