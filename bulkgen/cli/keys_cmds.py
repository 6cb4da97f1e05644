"""`bulkgen keys`: API keys of tenants, stored as hashes (the plain key is shown once, when made)."""

from __future__ import annotations

from pathlib import Path

import click

DEFAULT_KEYS_FILE = Path(".bulkgen") / "api-keys"

_file_option = click.option(
    "--file",
    "path",
    envvar="BULKGEN_API_KEYS",
    default=str(DEFAULT_KEYS_FILE),
    show_default=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The keys file `bulkgen serve --api-keys` reads.",
)


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
    click.echo(
        f"added a key for tenant {tenant!r} to {path}; it is not stored anywhere, keep it now", err=True
    )


@keys.command("list")
@_file_option
def list_keys(path: Path) -> None:
    """Every key in the keys file: its tenant and its label (sha256:PREFIX), what `keys revoke` takes."""
    from bulkgen.tenants import KeysFileError, key_label, read_keys_file

    try:
        hashes = read_keys_file(path)
    except KeysFileError as exc:
        raise click.ClickException(str(exc)) from None
    for key_hash, tenant in sorted(hashes.items(), key=lambda item: (item[1], item[0])):
        click.echo(f"{tenant}\t{key_label(key_hash)}")


@keys.command("revoke")
@click.argument("which", metavar="TENANT|sha256:PREFIX|KEY")
@_file_option
def revoke(which: str, path: Path) -> None:
    """Remove every key of TENANT, or the one key named by sha256:PREFIX (as `keys list` shows it) or by
    the plain key. A running service refuses the removed keys from its next request on."""
    from bulkgen.tenants import KeysFileError, key_label, revoke_keys

    try:
        removed = revoke_keys(path, which)
    except (ValueError, KeysFileError) as exc:
        raise click.ClickException(str(exc)) from None
    for tenant, key_hash in removed:
        click.echo(f"revoked {tenant}\t{key_label(key_hash)}")
