"""`bulkgen serve` (the job service) and `bulkgen run` (one shot, no server, embedded defaults)."""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import click

from bulkgen.cli.settings_options import pop_settings, setting_option, settings_flags, settings_from
from bulkgen.settings import BODY_TIMEOUT_S, Settings

# How long `serve` lets running requests finish once told to stop; the local runtime's own stop (a few
# seconds) comes after it, and the two stay within the 10 s docs/service.md promises.
SHUTDOWN_GRACE_S = 3.0


def runtime_options(fn):
    """The settings flags, turned into one `settings` argument (storage checked, and created if a folder)."""
    fn = settings_flags(fn)

    @functools.wraps(fn)
    def wrapper(**kwargs):
        settings = settings_from(pop_settings(kwargs))
        with runtime_errors():
            check_storage(settings.storage, settings.endpoint_url, create=True)
            check_adapters(settings)
            return fn(settings=settings, **kwargs)

    return wrapper


@contextlib.contextmanager
def runtime_errors():
    """Storage that cannot be used (at startup or later), Ray that cannot start or be joined, or GPUs that
    cannot hold the workers the models need: one line
    naming it and why, exit status 1."""
    from bulkgen.runtime import RayUnavailable, WorkersDoNotFit
    from bulkgen.store import StorageUnavailable

    try:
        yield
    except (StorageUnavailable, RayUnavailable, WorkersDoNotFit) as exc:
        raise click.ClickException(str(exc)) from None


def check_storage(url: str, endpoint_url: str | None, create: bool = False):
    """Open the storage and look at it once, before anything starts; -> the store. `create`: make a local
    storage folder that does not exist yet (serve, run and watch at start; never later)."""
    from bulkgen.store import open_store

    try:
        store = open_store(url, endpoint_url=endpoint_url)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if create:
        store.create()
    store.check(attempts=3)
    return store


def check_adapters(settings: Settings) -> None:
    """Every `--lora` adapter and the adapters file, before anything starts: one line naming the flag and
    why it cannot be served (its folder, its config, no base for it), exit status 1."""
    from bulkgen.models.loras import AdapterCatalog, AdapterError

    try:
        AdapterCatalog(settings.loras, settings.models, settings.lora_file, settings.endpoint_url)
    except AdapterError as exc:
        raise click.ClickException(str(exc)) from None


def webhook_options(fn):
    """--webhook / --webhook-secret, for `serve` and `watch`."""
    fn = click.option(
        "--webhook-secret",
        envvar="BULKGEN_WEBHOOK_SECRET",
        metavar="whsec_...",
        help="Signing secret, whsec_<base64> as OpenAI's (env BULKGEN_WEBHOOK_SECRET).",
    )(fn)
    return click.option(
        "--webhook",
        envvar="BULKGEN_WEBHOOK_URL",
        metavar="URL",
        help="POST a signed batch.completed/failed/expired/cancelled event here when a batch "
        "ends (env BULKGEN_WEBHOOK_URL); needs --webhook-secret.",
    )(fn)


def webhook_notifier(settings: Settings, url: str | None, secret: str | None):
    """Events are always signed, as the hosted API's are: a URL without a secret is refused. Undelivered
    events are kept in the storage, so a restarted service sends them."""
    if not url:
        return None
    if not secret:
        raise click.UsageError(
            "--webhook needs --webhook-secret (env BULKGEN_WEBHOOK_SECRET), a whsec_<base64> "
            'secret to sign events with; make one with: python -c "import base64, os; '
            "print('whsec_' + base64.b64encode(os.urandom(32)).decode())\""
        )
    from bulkgen.notify.webhooks import WebhookNotifier
    from bulkgen.store import open_store

    try:
        return WebhookNotifier(
            url, secret, store=open_store(settings.storage, endpoint_url=settings.endpoint_url)
        )
    except ValueError as exc:
        raise click.UsageError(f"--webhook/--webhook-secret: {exc}") from None


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option(
    "--api-key",
    envvar="BULKGEN_API_KEY",
    help="Require this one bearer key, for --tenant (env BULKGEN_API_KEY).",
)
@click.option(
    "--api-keys",
    "api_keys",
    envvar="BULKGEN_API_KEYS",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Tenants and their key hashes, 'TENANT SHA256' per line (see `bulkgen keys add`; env "
    "BULKGEN_API_KEYS). Each key sees only its tenant's files and batches.",
)
@click.option(
    "--allowed-hosts",
    envvar="BULKGEN_ALLOWED_HOSTS",
    default="",
    metavar="NAME[:PORT],.DOMAIN,...",
    help="Host names answered besides 127.0.0.1, localhost, [::1] and the bound address, comma-separated: "
    "NAME (any port), NAME:PORT, .DOMAIN (it and its subdomains) or '*' (any); for a proxy or DNS "
    "name in front. Other Host headers are refused (env BULKGEN_ALLOWED_HOSTS).",
)
@click.option(
    "--body-timeout",
    "body_timeout_s",
    type=click.FloatRange(min=0, min_open=True),
    default=BODY_TIMEOUT_S,
    show_default=True,
    help="Seconds a request body may stall (no bytes arriving) before it is refused with 408.",
)
@setting_option("refuse_infeasible")
@webhook_options
@runtime_options
def serve(
    settings: Settings,
    host: str,
    port: int,
    api_key: str | None,
    api_keys: Path | None,
    allowed_hosts: str,
    body_timeout_s: float,
    webhook: str | None,
    webhook_secret: str | None,
):
    """Run the OpenAI-compatible Files + Batches service."""
    import uvicorn

    from bulkgen.api import create_app
    from bulkgen.batch.service import BatchService
    from bulkgen.runtime.manager import BatchManager
    from bulkgen.tenants import KeyRing, KeysFileError

    if api_key and api_keys:
        raise click.UsageError("pass --api-key or --api-keys, not both")
    try:
        keyring = KeyRing.from_file(api_keys) if api_keys else None
    except KeysFileError as exc:
        raise click.ClickException(str(exc)) from None
    if keyring is not None and not keyring.tenants():
        raise click.ClickException(
            f"{api_keys} holds no keys: add one with `bulkgen keys add TENANT --file {api_keys}`"
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    notifier = webhook_notifier(settings, webhook, webhook_secret)
    svc = BatchService(settings, on_batch_end=notifier)
    manager = BatchManager(svc, weights=keyring.weights if keyring is not None else None)
    manager.start()
    click.echo(
        f"bulkgen serving {', '.join(settings.models)} on http://{host}:{port}/v1 (storage: {settings.storage})"
    )
    if keyring is not None:
        click.echo(f"API keys from {api_keys}: tenants {', '.join(keyring.tenants())}")
    app = create_app(
        svc, manager, api_key, keyring, allowed_hosts=allowed_hosts.split(","), body_timeout_s=body_timeout_s
    )
    # On SIGTERM, requests still running after the grace period are cancelled: shutdown is bounded.
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    if notifier is not None:
        notifier.close()  # a few seconds to send what is queued; the rest stays pending in the storage


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--output",
    "-o",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Output JSONL; errors go beside it as NAME.errors.jsonl, metrics as NAME.metrics.json.",
)
@click.option("--endpoint", help="Batch endpoint; default: the url of the file's first line.")
@click.option("--completion-window", default="24h", show_default=True)
@runtime_options
def run(settings: Settings, file: Path, output: Path, endpoint: str | None, completion_window: str):
    """Run FILE as one batch in this process (local Ray, no server) and write the results."""
    from bulkgen.batch.schema import BatchStatus
    from bulkgen.cli.oneshot import OneShotError, run_file

    try:
        summary = run_file(settings, file, output, endpoint, completion_window, echo=click.echo)
    except OneShotError as exc:
        raise click.ClickException(str(exc)) from None
    if summary.status != BatchStatus.COMPLETED:
        reasons = [e.get("message") for e in (summary.errors or {}).get("data", []) if e.get("message")]
        raise click.ClickException(f"batch ended {summary.status}" + (f": {reasons[0]}" if reasons else ""))
    counts = summary.request_counts
    if counts.total and not counts.completed:
        raise click.ClickException(f"no request succeeded: all {counts.failed} are in the error file")
