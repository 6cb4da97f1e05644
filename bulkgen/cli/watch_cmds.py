"""`bulkgen watch`: run every JSONL file dropped under a prefix as a batch, results under another prefix."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from bulkgen.cli.server_cmds import (
    check_adapters,
    check_storage,
    runtime_errors,
    webhook_notifier,
    webhook_options,
)
from bulkgen.cli.settings_options import override_flags, pop_flags, settings_flags, settings_from
from bulkgen.settings import Settings
from bulkgen.watch.job import Job, JobError


@click.command()
@click.option(
    "--job",
    "job_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A job definition (jobs/NAME.yaml); the options below override its fields.",
)
@override_flags(Job)
@click.option("--once", is_flag=True, help="Poll once, run what was found to its end, and exit.")
@webhook_options
@settings_flags
@click.pass_context
def watch(ctx: click.Context, job_path: Path | None, once: bool, webhook, webhook_secret, **flags):
    """Watch a prefix: each JSONL object that appears there runs once as a batch (visible through the API),
    and its results are written under the output prefix, named after it."""
    from bulkgen.batch.service import BatchService
    from bulkgen.watch.watcher import Watcher

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("botocore").setLevel(
        logging.WARNING
    )  # not "Found credentials in environment variables"
    job = _job(job_path, {**pop_flags(Job, flags), "webhook": webhook})
    settings = _settings(ctx, job, flags)
    # signed events once each batch's results are written under the output prefix
    notifier = webhook_notifier(settings, job.webhook, webhook_secret)
    try:
        watcher = Watcher(
            BatchService(settings), job, endpoint_url=settings.endpoint_url, on_batch_end=notifier
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


def _job(job_path: Path | None, given: dict[str, Any]) -> Job:
    """The job file's fields (none without --job), with what the command line gives over them."""
    try:
        job = Job.load(job_path) if job_path else Job()
        return job.override(**given).check(str(job_path or "bulkgen watch"))
    except JobError as exc:
        raise click.UsageError(str(exc)) from None


def _settings(ctx: click.Context, job: Job, flags: dict[str, Any]) -> Settings:
    """The service's settings: the job's storage, models, adapters and ranks where the command line leaves them out; the
    storage is checked (and a local folder made) before anything runs."""
    job_values = (
        ("storage", job.storage),
        ("models", tuple(job.models)),
        ("loras", tuple(job.loras)),
        ("tensor_parallel", job.rank_flags()),
    )
    for key, value in job_values:
        if value and ctx.get_parameter_source(key) == ParameterSource.DEFAULT:
            flags[key] = value
    settings = settings_from(flags)
    with runtime_errors():
        check_storage(settings.storage, settings.endpoint_url, create=True)
        check_adapters(settings)
    return settings
