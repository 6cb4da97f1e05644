"""The `bulkgen` command line: server, one-shot runs, batch client commands and analysis tools."""

from __future__ import annotations

import os

import click

from bulkgen import __version__

TRACEBACK_ENV = "BULKGEN_TRACEBACK"  # set: an unexpected error shows its whole traceback


class OneLineErrors(click.Group):
    """Every command's failure is one line on stderr (`Error: …`) and exit status 1: the commands' own
    errors already are (click.ClickException); anything else (a profile that could not be measured, a
    model that does not load) is put in one line too, instead of a traceback (BULKGEN_TRACEBACK=1 shows it)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            if os.environ.get(TRACEBACK_ENV):
                raise
            raise click.ClickException(one_line(exc)) from None


def one_line(exc: BaseException, limit: int = 500) -> str:
    """`exc` in one line: its message with the whitespace folded, after its type when that says more."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if type(exc).__module__ == "builtins" and type(exc).__name__ not in ("RuntimeError", "Exception"):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


@click.group(cls=OneLineErrors)
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
