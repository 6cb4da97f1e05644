"""Plain-text tables for terminal output, shared by the simulator, the policy bench and bench/."""

from __future__ import annotations

from bulkgen.metrics.health import describe_health


def text_table(rows: list[list[str]]) -> str:
    """Header row, a dashed rule, then the rows; the first column left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def describe_summary(summary: dict) -> str:
    """A batch's metrics summary as a short readable table (for `bulkgen status --metrics` and `run`)."""

    def num(value, fmt: str = "{:.3f}") -> str:
        return "-" if value is None else fmt.format(value)

    rows = [
        ["measure", "value"],
        ["requests", num(summary.get("requests"), "{}")],
        ["wall time (s)", num(summary.get("wall_time_s"), "{:.2f}")],
        ["output tokens", num(summary.get("output_tokens"), "{}")],
        ["output tokens/s", num(summary.get("output_tokens_per_s"), "{:.1f}")],
        ["input tokens/s", num(summary.get("input_tokens_per_s"), "{:.1f}")],
        ["cached prompt tokens", num(summary.get("cached_prompt_tokens"), "{}")],
        ["slot efficiency", num(summary.get("slot_efficiency"))],
        ["decode padding %", num(summary.get("decode_padding_pct"), "{:.1f}")],
        ["prefill padding %", num(summary.get("prefill_padding_pct"), "{:.1f}")],
        ["preemptions", num(summary.get("preemptions"), "{}")],
    ]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("queue_wait_s", "queue wait")):
        pct = summary.get(key) or {}
        rows.append(
            [
                f"{label} p50/p95/p99 (ms)",
                "/".join(
                    num(pct.get(p) * 1000 if pct.get(p) is not None else None, "{:.1f}")
                    for p in ("p50", "p95", "p99")
                ),
            ]
        )
    for name, counts in (summary.get("adapters") or {}).items():  # the rest ran on the base model
        rows.append(
            [f"adapter {name}", f"{counts['requests']} requests, {counts['output_tokens']} output tokens"]
        )
    rows += describe_health(summary.get("output_health"))
    return text_table(rows)
