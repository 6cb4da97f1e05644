"""The batch report stored beside the output: ``report.json`` plus a three-panel ``report.png``.

The PNG answers, at a glance, whether the hardware was kept busy: output tokens/s and slot occupancy
over the run, and how TTFT and TPOT were distributed.
"""

from __future__ import annotations

import io
import json

from bulkgen.metrics.batch import BatchMetrics

REPORT_JSON = "report.json"
REPORT_PNG = "report.png"


def render_report_png(report: dict) -> bytes:
    """PNG bytes of a report from ``BatchMetrics.report()``, ready to store in object storage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, points = report["summary"], report.get("timeline", [])
    fig, (ax_tps, ax_occ, ax_lat) = plt.subplots(3, 1, figsize=(9, 9))
    times = [p["t_s"] for p in points]
    ax_tps.plot(times, [p["output_tokens_per_s"] for p in points], drawstyle="steps-post")
    ax_tps.set_ylabel("output tokens/s")
    tps = summary.get("output_tokens_per_s")
    ax_tps.set_title(
        f"{summary['requests']} requests, {summary['output_tokens']} output tokens in "
        f"{summary['wall_time_s']:.2f} s" + (f" ({tps:.1f} tok/s)" if tps else ""),
        fontsize=10,
    )
    ax_occ.plot(times, [p["occupancy"] for p in points], drawstyle="steps-post", color="tab:green")
    ax_occ.set_ylim(0, 1.05)
    ax_occ.set_ylabel("slot occupancy")
    ax_occ.set_xlabel("seconds since first step")
    eff = summary.get("slot_efficiency")
    ax_occ.set_title("slot efficiency " + (f"{eff:.3f}" if eff is not None else "n/a"), fontsize=10)
    _plot_latency(ax_lat, report.get("latency_histograms", {}), summary)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()


def _plot_latency(ax, histograms: dict, summary: dict) -> None:
    for key, colour in (("ttft_ms", "tab:blue"), ("tpot_ms", "tab:orange")):
        hist = histograms.get(key) or {}
        if not hist.get("counts"):
            continue
        p = summary[key.replace("_ms", "_s")]
        label = f"{key[:4].upper()} p50 {p['p50'] * 1000:.1f} / p95 {p['p95'] * 1000:.1f} / p99 {p['p99'] * 1000:.1f} ms"
        ax.stairs(hist["counts"], hist["edges"], color=colour, label=label)
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("requests")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no latency samples", ha="center", va="center", transform=ax.transAxes)


def report_files(metrics: BatchMetrics, wall_time_s: float | None = None) -> dict[str, bytes]:
    """``{"report.json": ..., "report.png": ...}`` for the runner to write beside the batch output."""
    report = metrics.report(wall_time_s)
    return {
        REPORT_JSON: json.dumps(report, indent=2, sort_keys=True).encode(),
        REPORT_PNG: render_report_png(report),
    }
