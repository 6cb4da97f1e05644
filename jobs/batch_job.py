"""A Ray Job that runs one JSONL file already in object storage as a batch.

    ray job submit --address http://HEAD:8265 --working-dir . -- \\
        python jobs/batch_job.py --storage s3://bucket/bulkgen --input inbox/2026-11-30/labels.jsonl

Results land beside the service's own records, under --output-prefix (default `outbox/`), as
<name>.output.jsonl, <name>.errors.jsonl and <name>.summary.json (status, counts, usage, metrics). Schedulers (cron, Airflow, an
S3-notification consumer) call this once per file; the batch is visible through the API as usual.
"""

from __future__ import annotations

import sys

import click

from bulkgen.batch.schema import BatchStatus
from bulkgen.cli.oneshot import OneShotError, run_stored
from bulkgen.cli.server_cmds import runtime_options


@click.command()
@click.option("--input", "input_key", required=True, help="Key of the JSONL file under the storage URL.")
@click.option("--output-prefix", default="outbox", show_default=True, help="Where the results are written.")
@click.option("--completion-window", default="24h", show_default=True)
@runtime_options
def main(settings, input_key: str, output_prefix: str, completion_window: str) -> None:
    try:
        record = run_stored(settings, input_key, output_prefix, window=completion_window, echo=click.echo)
    except OneShotError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(0 if record.status == BatchStatus.COMPLETED else 1)


if __name__ == "__main__":
    main()
