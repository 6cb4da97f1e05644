"""Output health of a batch: what its answers are, not only that they ran.

A batch can be "completed" with every line a 200 and still be useless: empty answers, reasoning that
never reached an answer, JSON that fails the line's schema, tool calls the model began and botched. Bulk
users find out days later, by reading the file. `OutputHealth` counts, over a batch's answered lines, the
finish reason of every choice and each problem (CHECKS) by line, with the first SAMPLES custom_ids of each,
so the batch's metrics, `bulkgen status`, `bulkgen run`'s summary and the dashboard show it while the batch
runs. What a problem is, for each endpoint's body, is bulkgen.batch.health; this module only counts.
Bounded whatever the batch size: counters and at most SAMPLES ids per problem.
"""

from __future__ import annotations

from collections.abc import Iterable

CHECKS = (
    "empty_answer",  # no content, no tool call, no reasoning
    "reasoning_without_answer",  # reasoning, then nothing (often: max_tokens ran out while thinking)
    "schema_failed",  # response_format json_object / json_schema: the content is not a valid document
    "tool_call_unparsed",  # the model began a call in its format that did not parse: it stayed content
)
SAMPLES = 10


class OutputHealth:
    def __init__(self) -> None:
        self.answers = 0  # answered lines seen (200s)
        self.finish_reasons: dict[str, int] = {}  # every choice's
        self.counts = dict.fromkeys(CHECKS, 0)  # lines with each problem
        self.samples: dict[str, list[str]] = {check: [] for check in CHECKS}

    def add(self, custom_id: str, finish_reasons: Iterable[str | None], problems: Iterable[str]) -> None:
        """One answered line: its choices' finish reasons and the problems it has (each counted once)."""
        problems = set(problems)
        unknown = problems - set(CHECKS)
        if unknown:
            raise ValueError(f"unknown output health check {sorted(unknown)}; expected one of {CHECKS}")
        self.answers += 1
        for reason in finish_reasons:
            key = str(reason)
            self.finish_reasons[key] = self.finish_reasons.get(key, 0) + 1
        for check in problems:
            self.counts[check] += 1
            if len(self.samples[check]) < SAMPLES:
                self.samples[check].append(custom_id)

    def merge(self, state: dict) -> None:
        """Add another count's `to_state()` (a worker's range)."""
        other = OutputHealth.from_state(state)
        self.answers += other.answers
        for key, n in other.finish_reasons.items():
            self.finish_reasons[key] = self.finish_reasons.get(key, 0) + n
        for check in CHECKS:
            self.counts[check] += other.counts[check]
            room = SAMPLES - len(self.samples[check])
            self.samples[check].extend(other.samples[check][: max(0, room)])

    def summary(self) -> dict:
        return {
            "answers": self.answers,
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
            **{
                check: {"count": self.counts[check], "custom_ids": list(self.samples[check])}
                for check in CHECKS
            },
        }

    def to_state(self) -> dict:
        return {
            "answers": self.answers,
            "finish_reasons": dict(self.finish_reasons),
            "counts": dict(self.counts),
            "samples": {check: list(ids) for check, ids in self.samples.items()},
        }

    @classmethod
    def from_state(cls, state: dict | None) -> OutputHealth:
        health = cls()
        if not state:
            return health
        health.answers = int(state["answers"])
        health.finish_reasons = {str(k): int(v) for k, v in state["finish_reasons"].items()}
        for check in CHECKS:
            health.counts[check] = int(state["counts"].get(check, 0))
            health.samples[check] = [str(i) for i in state["samples"].get(check, ())][:SAMPLES]
        return health


def describe_health(summary: dict | None) -> list[list[str]]:
    """Table rows (measure, value) of an `OutputHealth.summary()`: the finish reasons, then each problem
    that occurred with its first custom_ids."""
    if not summary or not summary.get("answers"):
        return []
    rows = [["answers", str(summary["answers"])], ["finish reasons", _reasons(summary) or "-"]]
    for check in CHECKS:
        found = summary.get(check) or {}
        if found.get("count"):
            ids = ", ".join(found["custom_ids"][:3]) + (", ..." if found["count"] > 3 else "")
            rows.append([check.replace("_", " "), f"{found['count']} ({ids})"])
    return rows


def health_line(summary: dict | None) -> str | None:
    """One line for `bulkgen status`: the answers by finish reason, then each problem with its count."""
    if not summary or not summary.get("answers"):
        return None
    problems = [
        f"{summary[check]['count']} {check.replace('_', ' ')}"
        for check in CHECKS
        if (summary.get(check) or {}).get("count")
    ]
    return f"answers: {summary['answers']} ({_reasons(summary)}); " + (
        ", ".join(problems) or "no problem found"
    )


def _reasons(summary: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in summary["finish_reasons"].items())
