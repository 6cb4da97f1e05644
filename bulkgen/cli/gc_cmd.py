"""`bulkgen gc`: remove expired files, orphaned parts of ended batches and stale leases."""

from __future__ import annotations

import click

from bulkgen.cli.server_cmds import check_storage, runtime_errors
from bulkgen.settings import DEFAULT_STORAGE


@click.command()
@click.option(
    "--storage",
    envvar="BULKGEN_STORAGE",
    default=DEFAULT_STORAGE,
    show_default=True,
    help="The storage to clean: a folder, file:///…, or s3://bucket/prefix (env BULKGEN_STORAGE).",
)
@click.option(
    "--endpoint-url", envvar="AWS_ENDPOINT_URL", help="S3-compatible endpoint (env AWS_ENDPOINT_URL)."
)
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
def gc(storage: str, endpoint_url: str | None, dry_run: bool) -> None:
    """Remove expired files (data, record, refs), parts of ended batches and leases of ended batches.

    Safe while services run on the same storage: nothing an active batch reads is touched."""
    from bulkgen.batch.service import BatchService
    from bulkgen.runtime.gc import collect
    from bulkgen.settings import Settings

    with runtime_errors():
        store = check_storage(storage, endpoint_url)
        svc = BatchService(Settings(storage=storage, endpoint_url=endpoint_url), store=store)
        for line in collect(svc, dry_run=dry_run).lines(dry_run):
            click.echo(line)
