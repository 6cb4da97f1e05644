"""Analysis commands: `simulate` (batching policies on paper), `latency` (a request's budget) and
`bench` (the policies on the real engine). Thin wrappers: the logic lives in bulkgen.lab."""

from __future__ import annotations

import json
from pathlib import Path

import click

from bulkgen.lab.sim import DEFAULT_MAX_WAIT, POLICIES, LatencyBudget, SimulationInputError, Workload
from bulkgen.lab.sim import simulate as run_policy
from bulkgen.models.registry import default_model_path


def _int_list(option: str, text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(
            f"expected comma-separated integers, got {text!r}", param_hint=option
        ) from None


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if names == ["all"]:
        return list(POLICIES)
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise click.BadParameter(
            f"unknown policy {', '.join(unknown) or text!r}; use a comma list of "
            f"{', '.join(POLICIES)} or 'all'",
            param_hint="--policy",
        )
    return list(dict.fromkeys(names))


@click.command("simulate")
@click.option(
    "--policy",
    default="all",
    show_default=True,
    help="static, dynamic, continuous, a comma list of them, or all.",
)
@click.option("--max-batch", type=int, required=True, help="Slots: sequences that can run at once.")
@click.option("--lengths", required=True, help="Output tokens per request, e.g. 8,4,3,10.")
@click.option("--arrivals", help="Arrival step per request, non-decreasing (default: all at step 0).")
@click.option(
    "--max-wait",
    type=int,
    default=DEFAULT_MAX_WAIT,
    show_default=True,
    help="dynamic: launch a partial batch once the oldest request waited this many steps.",
)
@click.option("--prompt-lengths", help="Prompt tokens per request, to measure prefill padding.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per policy.")
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), help="Draw the slots over time to a PNG."
)
def simulate(
    policy: str,
    max_batch: int,
    lengths: str,
    arrivals: str | None,
    max_wait: int,
    prompt_lengths: str | None,
    as_json: bool,
    plot: Path | None,
) -> None:
    """Simulate static, dynamic and continuous batching step by step.

    One step produces one token for every active sequence; every sequence holding a slot costs one
    slot-step, including padding while it waits for its group. Requests r0..r(n-1) are in arrival order.

    \b
    static      fixed groups of --max-batch in arrival order; a group starts once the previous one
                ended and its last member arrived, and holds every slot until its longest member ends.
    dynamic     when idle, start a group once --max-batch requests wait or the oldest has waited
                --max-wait steps (it cannot know whether more will come); then as static.
    continuous  before every step, fill free slots with arrived requests in arrival order.
    \b
    A request arriving at step a can produce its first token in step a; its finish step is the number
    of steps elapsed when it (static/dynamic: its group) is done. With --prompt-lengths, static and
    dynamic pad each group's prompts to its longest; continuous packs them (no padding).
    """
    try:
        workload = Workload(
            _int_list("--lengths", lengths) or (),
            _int_list("--arrivals", arrivals) or (),
            _int_list("--prompt-lengths", prompt_lengths),
        )
        results = [run_policy(workload, name, max_batch, max_wait) for name in _policies(policy)]
    except SimulationInputError as exc:
        raise click.BadParameter(exc.detail, param_hint="--" + exc.field.replace("_", "-")) from None
    from bulkgen.lab.sim.render import format_report

    click.echo("\n".join(json.dumps(r.metrics()) for r in results) if as_json else format_report(results))
    if plot is not None:
        from bulkgen.lab.sim.render import plot_timelines

        plot_timelines(results, plot)
        if not as_json:
            click.echo(f"\nplot written to {plot}")


@click.command()
@click.option("--ttft-ms", type=float, required=True, help="Time to first token, ms.")
@click.option("--tpot-ms", type=float, required=True, help="Time per output token after the first, ms.")
@click.option("--output-tokens", type=int, required=True, help="Tokens the request generates.")
@click.option("--json", "as_json", is_flag=True, help="Print the parts as JSON.")
def latency(ttft_ms: float, tpot_ms: float, output_tokens: int, as_json: bool) -> None:
    """End-to-end latency of one request: TTFT + TPOT × (N − 1), with the parts shown."""
    try:
        budget = LatencyBudget(ttft_ms, tpot_ms, output_tokens)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(json.dumps(budget.as_dict()) if as_json else budget.describe())


@click.command()
@click.argument("batch_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--policy",
    default="static,dynamic,continuous",
    show_default=True,
    help="A comma list of static, dynamic, continuous, or all.",
)
@click.option(
    "--model",
    "model_path",
    default=default_model_path(),
    show_default=True,
    envvar="BULKGEN_MODEL",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Local model directory.",
)
@click.option("--max-num-seqs", type=int, default=64, show_default=True, help="Engine slots.")
@click.option("--ignore-eos", is_flag=True, help="Generate exactly max_tokens per request.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary per policy.")
def bench(
    batch_file: Path, policy: str, model_path: Path, max_num_seqs: int, ignore_eos: bool, as_json: bool
) -> None:
    """Run BATCH_FILE (OpenAI batch JSONL) through the real engine under each policy, side by side."""
    from transformers.utils import logging as hf_logging

    from bulkgen.lab.policy_bench import BenchInputError, compare_policies, format_comparison

    hf_logging.disable_progress_bar()  # one progress bar per engine load would bury the table

    try:
        rows = compare_policies(model_path, batch_file, _policies(policy), max_num_seqs, ignore_eos)
    except BenchInputError as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        click.echo("\n".join(json.dumps(row) for row in rows))
    else:
        click.echo(format_comparison(rows))
