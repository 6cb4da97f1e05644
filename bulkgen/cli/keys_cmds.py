"""`bulkgen keys`: API keys of tenants, stored as hashes (the plain key is shown once, when made)."""

from __future__ import annotations

from pathlib import Path

import click

DEFAULT_KEYS_FILE = Path(".bulkgen") / "api-keys"

_file_option = click.option(
    "--file", "path", envvar="BULKGEN_API_KEYS", default=str(DEFAULT_KEYS_FILE), show_default=True,
    type=click.Path(dir_okay=False, path_type=Path), help="The keys file `bulkgen serve --api-keys` reads.")


@click.group()
def keys() -> None:
    """Tenants' API keys (the file holds only their SHA-256)."""


@keys.command("add")
@click.argument("tenant")
@_file_option
def add(tenant: str, path: Path) -> None:
    """Make a new key for TENANT: printed once on stdout, its hash appended to the keys file."""
    from bulkgen.tenants import KeysFileError, add_key

    try:
        key = add_key(path, tenant)
    except (ValueError, KeysFileError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(key)
    click.echo(f"added a key for tenant {tenant!r} to {path}; it is not stored anywhere, keep it now", err=True)


@keys.command("list")
@_file_option
def list_tenants(path: Path) -> None:
    """The tenants in the keys file, with how many keys each has."""
    from bulkgen.tenants import KeysFileError, read_keys_file

    try:
        hashes = read_keys_file(path)
    except KeysFileError as exc:
        raise click.ClickException(str(exc)) from None
    counts: dict[str, int] = {}
    for tenant in hashes.values():
        counts[tenant] = counts.get(tenant, 0) + 1
    for tenant, count in sorted(counts.items()):
        click.echo(f"{tenant}\t{count} key{'s' if count > 1 else ''}")
