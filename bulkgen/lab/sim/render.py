"""Terminal tables, per-slot timelines and a PNG of the simulator's results."""

from __future__ import annotations

import io
import string
from pathlib import Path

from bulkgen.lab.sim.batching import SimResult
from bulkgen.metrics.table import text_table

MAX_TIMELINE_STEPS = 120
_ID_CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase

# (label, metrics key, format) for the side-by-side table.
TABLE_ROWS = [
    ("makespan (steps)", "makespan", "{}"),
    ("slot-steps", "slot_steps", "{}"),
    ("useful tokens", "useful_tokens", "{}"),
    ("wasted slot-steps", "wasted_slot_steps", "{}"),
    ("waste %", "waste_pct", "{:.2f}"),
    ("useful tokens / step", "useful_tokens_per_step", "{:.3f}"),
    ("raw occupancy", "raw_occupancy", "{:.3f}"),
    ("slot efficiency", "slot_efficiency", "{:.3f}"),
    ("prefill slots", "prefill_slots", "{}"),
    ("prefill useful", "prefill_useful", "{}"),
    ("prefill waste %", "prefill_waste_pct", "{:.2f}"),
]


def format_table(metrics: list[dict]) -> str:
    """One column per policy, one row per measure, so a single call compares policies."""
    header = ["", *(m["policy"] for m in metrics)]
    rows = [header]
    for label, key, fmt in TABLE_ROWS:
        if key in metrics[0]:
            rows.append([label, *(fmt.format(m[key]) for m in metrics)])
    return text_table(rows)


def format_report(results: list[SimResult]) -> str:
    """The side-by-side table, then each policy's timeline and finish steps."""
    metrics = [result.metrics() for result in results]
    parts = [format_table(metrics)]
    for result, m in zip(results, metrics, strict=True):
        parts.append(format_timeline(result) + "\n" + format_finish_steps(m))
    return "\n\n".join(parts)


def format_finish_steps(metrics: dict) -> str:
    return "finish steps: " + " ".join(f"{rid}={step}" for rid, step in metrics["finish_steps"].items())


def request_char(request: int) -> str:
    """A one-character label for a request (r0..r9, then a..z, A..Z, then repeats)."""
    return _ID_CHARS[request % len(_ID_CHARS)]


def format_timeline(result: SimResult) -> str:
    """A row per slot, a column per step: the request's label while it produces tokens, '.' while
    it only holds the slot (padding), blank while the slot is empty."""
    makespan = result.makespan
    if makespan > MAX_TIMELINE_STEPS:
        return f"{result.policy}: timeline omitted ({makespan} steps > {MAX_TIMELINE_STEPS}); use --plot"
    grid = [[" "] * makespan for _ in range(result.max_batch)]
    for seg in result.segments:
        for step in range(seg.start, seg.release):
            grid[seg.slot][step] = request_char(seg.request) if step < seg.done else "."
    ruler = "".join(str(step % 10) for step in range(makespan))
    width = len(str(result.max_batch - 1))
    lines = [f"{result.policy} (label = request id, '.' = padding slot-step)", f"{'':>{width + 5}} {ruler}"]
    lines += [f"slot {s:>{width}}|{''.join(row)}|" for s, row in enumerate(grid)]
    return "\n".join(lines)


def plot_timelines(results: list[SimResult], target: str | Path | io.BytesIO) -> None:
    """Slots over time, one panel per policy: coloured bars are tokens, grey bars padding."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    makespan = max(r.makespan for r in results)
    max_batch = results[0].max_batch
    fig, axes = plt.subplots(
        len(results), 1, figsize=(10, 1.2 + 0.45 * max_batch * len(results)), squeeze=False
    )
    cmap = plt.get_cmap("tab20")
    for ax, result in zip(axes[:, 0], results, strict=True):
        for seg in result.segments:
            colour = cmap(seg.request % 20)
            ax.broken_barh([(seg.start, seg.done - seg.start)], (seg.slot - 0.4, 0.8), facecolors=colour)
            if seg.release > seg.done:
                ax.broken_barh(
                    [(seg.done, seg.release - seg.done)],
                    (seg.slot - 0.4, 0.8),
                    facecolors="lightgrey",
                    hatch="//",
                    edgecolor="grey",
                )
            if seg.done - seg.start >= 2 and makespan <= 200:
                ax.text(
                    (seg.start + seg.done) / 2,
                    seg.slot,
                    f"r{seg.request}",
                    ha="center",
                    va="center",
                    fontsize=7,
                )
        m = result.metrics()
        ax.set_title(
            f"{result.policy}: makespan {m['makespan']}, slot efficiency {m['slot_efficiency']:.2f}",
            fontsize=9,
        )
        ax.set_xlim(0, makespan)
        ax.set_ylim(-0.6, max_batch - 0.4)
        ax.set_yticks(range(max_batch))
        ax.set_ylabel("slot")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(target, format="png", dpi=100)
    plt.close(fig)
