"""`bulkgen watch`: run every JSONL file dropped under a prefix as a batch, results under another prefix."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import click
from click.core import ParameterSource

from bulkgen.batch.schema import ENDPOINTS
from bulkgen.cli.server_cmds import (
    check_adapters,
    check_storage,
    runtime_errors,
    webhook_notifier,
    webhook_options,
)
from bulkgen.cli.settings_options import settings_flags, settings_from


@click.command()
@click.option(
    "--job",
    "job_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A job definition (jobs/NAME.yaml); the options below override its fields.",
)
@click.option("--input", "input_url", help="Prefix to watch: a folder or s3://bucket/inbox/.")
@click.option("--output", "output_url", help="Where results go: a folder or s3://bucket/outbox/.")
@click.option(
    "--interval", type=float, help="Seconds between polls (default 10; 300 beside --sqs-queue-url)."
)
@click.option(
    "--schedule", help="Poll at these times instead: a 5-field cron expression (UTC), e.g. '*/5 * * * *'."
)
@click.option("--sqs-queue-url", help="Also react to S3 event notifications delivered to this SQS queue.")
@click.option(
    "--endpoint",
    type=click.Choice(ENDPOINTS),
    help="Batch endpoint; default: the url of each file's first line.",
)
@click.option("--completion-window", help="Completion window of the batches (default 24h).")
@click.option(
    "--output-format", type=click.Choice(["jsonl", "parquet"]), help="Result format (default jsonl)."
)
@click.option(
    "--claim-ttl",
    type=float,
    help="Seconds before another watcher takes over an object whose watcher stopped (default 60).",
)
@click.option("--once", is_flag=True, help="Poll once, run what was found to its end, and exit.")
@webhook_options
@settings_flags
@click.pass_context
def watch(
    ctx: click.Context,
    job_path: Path | None,
    input_url,
    output_url,
    interval,
    schedule,
    sqs_queue_url,
    endpoint,
    completion_window,
    output_format,
    claim_ttl,
    once: bool,
    webhook,
    webhook_secret,
    **runtime,
):
    """Watch a prefix: each JSONL object that appears there runs once as a batch (visible through the API),
    and its results are written under the output prefix, named after it."""
    from bulkgen.batch.service import BatchService
    from bulkgen.watch.jobspec import JobError, JobSpec
    from bulkgen.watch.watcher import Watcher

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("botocore").setLevel(
        logging.WARNING
    )  # not "Found credentials in environment variables"
    try:
        spec = JobSpec.load(job_path) if job_path else JobSpec()
        spec.override(
            input=input_url,
            output=output_url,
            interval=interval,
            schedule=schedule,
            sqs_queue_url=sqs_queue_url,
            endpoint=endpoint,
            completion_window=completion_window,
            output_format=output_format,
            claim_ttl=claim_ttl,
            webhook=webhook,
        )
        spec.check(str(job_path or "bulkgen watch"))
    except JobError as exc:
        raise click.UsageError(str(exc)) from None
    job = (("storage", spec.storage), ("models", tuple(spec.models)), ("loras", tuple(spec.loras)))
    for key, value in job:  # the job's, unless given
        if value and ctx.get_parameter_source(key) == ParameterSource.DEFAULT:
            runtime[key] = value
    settings = settings_from(runtime)
    with runtime_errors():
        check_storage(settings.storage, settings.endpoint_url, create=True)
        check_adapters(settings)
    # signed events once each batch's results are written under the output prefix
    notifier = webhook_notifier(settings, spec.webhook, webhook_secret)
    try:
        watcher = Watcher(
            BatchService(settings), spec, endpoint_url=settings.endpoint_url, on_batch_end=notifier
        )
    except (JobError, ValueError) as exc:
        raise click.UsageError(str(exc)) from None
    signal.signal(signal.SIGTERM, lambda *_: watcher.stop())
    try:
        with runtime_errors():
            watcher.run(once=once)
    except KeyboardInterrupt:
        watcher.close()
    finally:
        if notifier is not None:
            notifier.close()  # a few seconds to send what is queued; the rest stays pending in the storage
