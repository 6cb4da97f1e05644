"""`bulkgen gc`: remove expired files, orphaned parts of ended batches and stale leases."""

from __future__ import annotations

import click

from bulkgen.cli.server_cmds import check_storage, runtime_errors
from bulkgen.cli.settings_options import setting_option


@click.command()
@setting_option("storage")
@setting_option("endpoint_url")
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
