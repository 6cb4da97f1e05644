"""The `bulkgen` command line: server, one-shot runs, batch client commands and analysis tools."""

from __future__ import annotations

import click

from bulkgen import __version__


@click.group()
@click.version_option(__version__, prog_name="bulkgen")
def cli() -> None:
    """Offline bulk LLM generation behind an OpenAI-compatible Files + Batches API."""


def _register() -> None:
    from bulkgen.cli import analysis, client_cmds, gc_cmd, keys_cmds, plan_cmds, server_cmds, watch_cmds

    commands = (
        server_cmds.serve,
        server_cmds.run,
        client_cmds.submit,
        client_cmds.status,
        client_cmds.list_batches,
        client_cmds.cancel,
        client_cmds.results,
        watch_cmds.watch,
        analysis.simulate,
        analysis.latency,
        analysis.bench,
        keys_cmds.keys,
        gc_cmd.gc,
        client_cmds.retry,
        plan_cmds.plan,
        plan_cmds.profile_cmd,
    )
    for command in commands:
        cli.add_command(command)


_register()
