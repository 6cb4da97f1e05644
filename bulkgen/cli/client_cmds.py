"""Client commands: talk to a running `bulkgen serve` (or any OpenAI-compatible batch API)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from bulkgen.batch.schema import BatchStatus
from bulkgen.cli import client as c

base_url_option = click.option(
    "--base-url",
    envvar="OPENAI_BASE_URL",
    default="http://127.0.0.1:8000/v1",
    show_default=True,
    help="API base URL (env OPENAI_BASE_URL).",
)
api_key_option = click.option(
    "--api-key", envvar="OPENAI_API_KEY", default="bulkgen", help="API key (env OPENAI_API_KEY)."
)


def _client(base_url: str, api_key: str):
    return c.make_client(base_url, api_key)


def _call(fn, *args, **kwargs):
    """Run an SDK call, turning API and connection errors into one readable line."""
    import openai

    try:
        return fn(*args, **kwargs)
    except openai.APIStatusError as exc:
        message = exc.body.get("message") if isinstance(exc.body, dict) else str(exc)
        raise click.ClickException(f"{exc.status_code}: {message}") from None
    except openai.APIConnectionError:
        raise click.ClickException(
            "cannot reach the server; is `bulkgen serve` running at --base-url?"
        ) from None


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--endpoint", help="Batch endpoint; default: the url of the file's first line.")
@click.option("--completion-window", default="24h", show_default=True)
@click.option("--metadata", "metadata", multiple=True, help="KEY=VALUE, repeatable.")
@click.option("--wait/--no-wait", default=False, help="Wait with a progress bar, then download the results.")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where --wait writes results (errors beside it as NAME.errors.jsonl).",
)
@base_url_option
@api_key_option
def submit(file, endpoint, completion_window, metadata, wait, output, base_url, api_key):
    """Upload FILE (JSONL) and create a batch from it."""
    try:
        endpoint = endpoint or c.detect_endpoint(file)
    except c.ClientError as exc:
        raise click.ClickException(str(exc)) from None
    pairs = dict(m.split("=", 1) for m in metadata if "=" in m)
    client = _client(base_url, api_key)
    with file.open("rb") as f:
        uploaded = _call(client.files.create, file=(file.name, f), purpose="batch")
    batch = _call(
        client.batches.create,
        input_file_id=uploaded.id,
        endpoint=endpoint,
        completion_window=completion_window,
        metadata=pairs or None,
    )
    batch = c.validated(lambda: _call(client.batches.retrieve, batch.id))
    click.echo(
        f"{batch.id} {batch.status} ({batch.request_counts.total if batch.request_counts else 0} requests)"
    )
    if batch.status == BatchStatus.FAILED:
        raise click.ClickException(f"batch failed validation:\n{c.format_errors(batch)}")
    if wait:
        _wait_and_download(client, batch, output or Path(f"{batch.id}_output.jsonl"))


def _wait_and_download(client, batch, output: Path) -> None:
    total = max(1, batch.request_counts.total if batch.request_counts else 1)
    with click.progressbar(length=total, label="requests", show_pos=True) as bar:
        done = [0]

        def update(b):
            counts = b.request_counts
            now = (counts.completed + counts.failed) if counts else 0
            bar.update(now - done[0])
            done[0] = now

        batch = c.wait(lambda: _call(client.batches.retrieve, batch.id), update)
    counts = batch.request_counts
    click.echo(f"{batch.id} {batch.status}: {counts.completed} completed, {counts.failed} failed")
    for line in c.download(client, batch, output):
        click.echo(f"wrote {line}")
    if batch.status != BatchStatus.COMPLETED:
        raise click.ClickException(f"batch ended {batch.status}")


@click.command()
@click.argument("batch_id")
@click.option("--metrics", is_flag=True, help="Show the batch's throughput, efficiency and latency metrics.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole batch object as JSON.")
@base_url_option
@api_key_option
def status(batch_id, metrics, as_json, base_url, api_key):
    """Show a batch's status and progress."""
    batch = _call(_client(base_url, api_key).batches.retrieve, batch_id)
    if as_json:
        click.echo(json.dumps(batch.model_dump(), indent=2))
        return
    counts = batch.request_counts
    eta = ((batch.model_extra or {}).get("metrics") or {}).get("eta_s")
    left = f", about {_duration(eta)} left" if batch.status == BatchStatus.IN_PROGRESS and eta else ""
    click.echo(
        f"{batch.id}  {batch.status}  {counts.completed}/{counts.total} completed, {counts.failed} failed{left}"
    )
    from bulkgen.metrics.health import health_line

    health = health_line(((batch.model_extra or {}).get("metrics") or {}).get("output_health"))
    if health:
        click.echo(health)
    if batch.errors and batch.errors.data:
        click.echo(c.format_errors(batch))
    if metrics:
        from bulkgen.metrics.table import describe_summary

        summary = (batch.model_extra or {}).get("metrics")
        click.echo(describe_summary(summary) if summary else "no metrics yet")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


@click.command(name="list")
@click.option("--limit", default=20, show_default=True, help="How many batches (newest first).")
@base_url_option
@api_key_option
def list_batches(limit, base_url, api_key):
    """List batches, newest first."""
    page = _call(_client(base_url, api_key).batches.list, limit=min(limit, 100))
    for i, batch in enumerate(page):
        if i >= limit:
            break
        counts = batch.request_counts
        click.echo(f"{batch.id}  {batch.status:<11} {counts.completed}/{counts.total}  {batch.endpoint}")


@click.command()
@click.argument("batch_id")
@base_url_option
@api_key_option
def cancel(batch_id, base_url, api_key):
    """Cancel a batch; finished requests are kept in its output file."""
    batch = _call(_client(base_url, api_key).batches.cancel, batch_id)
    click.echo(f"{batch.id} {batch.status}")


@click.command()
@click.argument("batch_id")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Output path (errors beside it); default BATCH_output.jsonl.",
)
@click.option(
    "--merged",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write one file across the batch and its retries instead (errors beside it): each custom_id "
    "once, in input order, its newest success or else its last error.",
)
@base_url_option
@api_key_option
def results(batch_id, output, merged, base_url, api_key):
    """Download a batch's output and error files."""
    client = _client(base_url, api_key)
    if merged:
        try:
            chain = c.retry_chain(lambda b: _call(client.batches.retrieve, b), batch_id)
            written = _call(
                c.download_merged, client, chain, merged
            )  # a result file gone: one line, no traceback
        except c.ClientError as exc:
            raise click.ClickException(str(exc)) from None
        for line in written:
            click.echo(f"wrote {line}" if not line.startswith("across") else line)
        return
    batch = _call(client.batches.retrieve, batch_id)
    if not (batch.output_file_id or batch.error_file_id):
        raise click.ClickException(f"{batch_id} is {batch.status} and has no result files yet")
    for line in c.download(client, batch, output or Path(f"{batch_id}_output.jsonl")):
        click.echo(f"wrote {line}")


@click.command()
@click.argument("batch_id")
@click.option("--wait/--no-wait", default=False, help="Wait with a progress bar, then download the results.")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where --wait writes the retry's results (errors beside it as NAME.errors.jsonl).",
)
@base_url_option
@api_key_option
def retry(batch_id, wait, output, base_url, api_key):
    """Create a batch of the requests of an ended BATCH_ID that did not succeed and may succeed now
    (engine errors, expired, cancelled, never run; not 400s). `results --merged` joins them."""
    from openai.types import Batch

    client = _client(base_url, api_key)
    batch = _call(client.post, f"/batches/{batch_id}/retry", cast_to=Batch)
    batch = c.validated(lambda: _call(client.batches.retrieve, batch.id))
    total = batch.request_counts.total if batch.request_counts else 0
    click.echo(f"{batch.id} {batch.status} ({total} requests, retrying {batch_id})")
    if wait:
        _wait_and_download(client, batch, output or Path(f"{batch.id}_output.jsonl"))
