"""The latency budget of one request: time to first token plus one TPOT per further token.

Users size completion windows and interactive budgets from two numbers the engine reports (TTFT and
TPOT); this makes the arithmetic, and which part dominates, explicit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LatencyBudget:
    """End-to-end ≈ TTFT + TPOT × (N − 1): the first token pays prefill, the others one decode step each."""

    ttft_ms: float
    tpot_ms: float
    output_tokens: int

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if (
            isinstance(self.output_tokens, bool)
            or not isinstance(self.output_tokens, int)
            or self.output_tokens < 1
        ):
            raise ValueError(f"output_tokens must be an integer >= 1, got {self.output_tokens!r}")

    @property
    def decode_ms(self) -> float:
        return self.tpot_ms * (self.output_tokens - 1)

    @property
    def end_to_end_ms(self) -> float:
        return self.ttft_ms + self.decode_ms

    def as_dict(self) -> dict:
        return {**asdict(self), "decode_ms": self.decode_ms, "end_to_end_ms": self.end_to_end_ms}

    def describe(self) -> str:
        total = self.end_to_end_ms
        share = (lambda part: f"{100 * part / total:.1f}%") if total else (lambda part: "n/a")
        return "\n".join(
            [
                f"TTFT                          {self.ttft_ms:>12.2f} ms  ({share(self.ttft_ms)})",
                f"decode  {self.tpot_ms:g} ms × {self.output_tokens - 1} tokens".ljust(30)
                + f"{self.decode_ms:>12.2f} ms  ({share(self.decode_ms)})",
                f"end-to-end                    {total:>12.2f} ms",
            ]
        )
