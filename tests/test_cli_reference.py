"""docs/cli-reference.md is generated from the click commands: the committed page must be what they say now."""

from __future__ import annotations

from pathlib import Path

import click

from bulkgen.cli import reference

PAGE = Path(__file__).resolve().parents[1] / "docs" / "cli-reference.md"


def test_the_committed_reference_is_what_the_commands_say():
    assert PAGE.read_text() == reference.render(), (
        "docs/cli-reference.md is stale: python -m bulkgen.cli.reference > docs/cli-reference.md"
    )


def test_every_command_option_default_and_env_var_is_on_the_page():
    @click.group()
    def tool():
        """A tool."""

    @tool.command()
    @click.option("--size", type=int, default=3, envvar="TOOL_SIZE", help="How big | wide.")
    @click.option("--quiet", is_flag=True, help="Say less.")
    @click.argument("path")
    def make(size, quiet, path):
        """Make PATH.

        Indented second paragraph."""

    page = reference.render(tool)
    assert "## `bulkgen make`" in page and "Make PATH.\n\nIndented second paragraph." in page
    assert "bulkgen make [OPTIONS] PATH" in page
    assert "| `--size` INTEGER | `3` | `TOOL_SIZE` | How big \\| wide. |" in page
    assert "| `--quiet` |  |  | Say less. |" in page and "--help" not in page
