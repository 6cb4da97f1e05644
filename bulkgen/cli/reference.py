"""The command-line reference page (docs/cli-reference.md), generated from the click commands themselves:
each command's help text, usage line and options with their defaults and environment variables, so the
page cannot drift from the code (tests/test_cli_reference.py compares the committed page with this).

    python -m bulkgen.cli.reference > docs/cli-reference.md
"""

from __future__ import annotations

import inspect
from pathlib import Path

import click

import bulkgen

PACKAGE = str(Path(bulkgen.__file__).parent)

HEADER = (
    "# Command-line reference\n\n"
    "Generated from the click commands by `python -m bulkgen.cli.reference > docs/cli-reference.md`; "
    "[cli.md](cli.md) is the overview.\n"
)


def render(group: click.Group | None = None) -> str:
    """The whole page: every command (and subcommand) in the order `bulkgen --help` lists them."""
    if group is None:
        from bulkgen.cli import cli

        group = cli
    ctx = click.Context(group, info_name="bulkgen")
    sections = [HEADER]
    for name in group.list_commands(ctx):
        sections += _command_sections(group.get_command(ctx, name), ["bulkgen", name], ctx)
    return "\n".join(sections)


def _command_sections(command: click.Command, path: list[str], parent: click.Context) -> list[str]:
    ctx = click.Context(command, info_name=path[-1], parent=parent)
    usage = " ".join([*path, *command.collect_usage_pieces(ctx)])
    text = [f"## `{' '.join(path)}`\n", inspect.cleandoc(command.help or "") + "\n", f"```\n{usage}\n```\n"]
    rows = [_option_row(p, ctx) for p in command.get_params(ctx) if isinstance(p, click.Option)]
    rows = [r for r in rows if r]
    if rows:
        text.append("| option | default | env | what |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")
    out = ["\n".join(text)]
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            out += _command_sections(command.get_command(ctx, name), [*path, name], ctx)
    return out


def _option_row(option: click.Option, ctx: click.Context) -> str | None:
    if option.hidden or "--help" in option.opts:
        return None
    default = option.get_default(ctx, call=False)
    if not isinstance(default, (str, int, float, tuple)) or default in ("", ()) or option.is_flag:
        default = None
    elif isinstance(default, str) and default.startswith(PACKAGE):  # the bundled model's folder
        default = "<bulkgen package>" + default[len(PACKAGE) :]
    names = ", ".join(f"`{n}`" for n in option.opts + option.secondary_opts)
    metavar = "" if option.is_flag else f" {option.make_metavar(ctx)}"
    shown = "" if default is None else f"`{default}`"
    env = option.envvar if isinstance(option.envvar, str) else ", ".join(option.envvar or ())
    what = " ".join((option.help or "").split()).replace("|", "\\|")
    return (
        f"| {names}{metavar.replace('|', chr(92) + '|')} | {shown} | {f'`{env}`' if env else ''} | {what} |"
    )


if __name__ == "__main__":
    print(render(), end="")
