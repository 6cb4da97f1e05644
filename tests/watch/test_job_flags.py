"""`bulkgen watch`'s job options are made from Job's fields, as the service's are from Settings': a
field's flag, help and check are written once, and a flag overrides the job file only when given."""

from __future__ import annotations

from dataclasses import fields

import click
import pytest

from bulkgen.cli.settings_options import pop_settings
from bulkgen.cli.watch_cmds import _job, _settings, watch
from bulkgen.watch.job import Job

JOB = """\
input: {inbox}
output: {outbox}
interval: 30
output_format: parquet
claim_ttl: 120
"""


def _options() -> dict[str, click.Option]:
    return {p.name: p for p in watch.params if isinstance(p, click.Option)}


def test_every_flagged_job_field_is_a_watch_option_with_its_help():
    flagged = {f.name: f.metadata["flag"] for f in fields(Job) if f.metadata.get("flag")}
    assert set(flagged) == {
        "input",
        "output",
        "endpoint",
        "completion_window",
        "interval",
        "schedule",
        "sqs_queue_url",
        "output_format",
        "claim_ttl",
    }
    options = _options()
    for name, flag in flagged.items():
        option = options[name]
        assert option.opts == [flag.name] and option.help == flag.help
        assert option.default is None  # absent from the command line: the job file's value stands
    assert isinstance(options["output_format"].type, click.Choice)
    assert options["claim_ttl"].type == click.FLOAT


def test_a_given_flag_overrides_the_job_and_the_rest_stand(tmp_path):
    path = tmp_path / "labels.yaml"
    path.write_text(JOB.format(inbox=tmp_path / "in", outbox=tmp_path / "out"))
    given = {name: None for name in ("input", "output", "endpoint", "schedule", "output_format")}
    job = _job(path, {**given, "claim_ttl": 5.0, "interval": None, "webhook": None})
    assert (job.claim_ttl, job.interval, job.output_format, job.name) == (5.0, 30, "parquet", "labels")
    job = _job(path, {"schedule": "*/5 * * * *"})  # a schedule given replaces the job's interval
    assert (job.schedule, job.interval) == ("*/5 * * * *", None)


def test_a_bad_flag_is_a_usage_error_naming_the_field(tmp_path):
    path = tmp_path / "labels.yaml"
    path.write_text(JOB.format(inbox=tmp_path / "in", outbox=tmp_path / "out"))
    with pytest.raises(click.UsageError, match=r"labels.yaml: claim_ttl must be at least 1 second; got 0.5"):
        _job(path, {"claim_ttl": 0.5})


def _watch_settings(path, *args: str):
    """The settings `bulkgen watch --job PATH ARGS` runs with (its storage folder made, nothing started)."""
    ctx = watch.make_context("watch", ["--job", str(path), *args])
    flags = pop_settings(dict(ctx.params))
    return _settings(ctx, _job(path, {}), flags)


def test_a_job_sets_tensor_parallel_per_model_and_the_command_line_wins(tmp_path):
    path = tmp_path / "big.yaml"
    served = f"storage: {tmp_path / 'store'}\nmodels: [big=/m/big, small=/m/small]\n"
    path.write_text(
        JOB.format(inbox=tmp_path / "in", outbox=tmp_path / "out") + served + "tensor_parallel: {big: 2}\n"
    )
    settings = _watch_settings(path)
    assert settings.workers.tensor_parallel == {"big": 2} and settings.rank_counts() == [1, 2]
    assert _watch_settings(path, "--tensor-parallel", "4").workers.tensor_parallel == {"*": 4}
    path.write_text(
        JOB.format(inbox=tmp_path / "in", outbox=tmp_path / "out") + served + "tensor_parallel: {huge: 2}\n"
    )
    with pytest.raises(click.UsageError, match=r"^--tensor-parallel: no served model is named 'huge'"):
        _watch_settings(path)
