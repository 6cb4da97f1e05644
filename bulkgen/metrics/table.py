"""Plain-text tables for terminal output, shared by the simulator, the policy bench and bench/."""

from __future__ import annotations


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
