"""Weighted fair shares of worker capacity between tenants: whose work the queue hands out next.

Virtual time per tenant: the tokens of work (prompt plus output budget, from the line index) handed out
to it, divided by its weight. The tenant with the least virtual time goes next, so over a long run each
backlogged tenant gets work in proportion to its weight (equal by default). A tenant that had nothing
queued joins at the least virtual time of those that have, so being idle earns no credit to spend later
in a burst. When a range finishes, its charge is corrected to the tokens really used (requests that stop
early cost less than their `max_tokens`); a range that goes back to the queue unfinished is refunded.

Weights come from a callable (the keys file's `TENANT weight=W` lines over `--tenant-weight` flags),
read at most once per WEIGHTS_EVERY_S.

Bounded: one number per tenant ever seen (tenants are few and named by an operator).

The engine's waiting queue (bulkgen.engine.waiting) applies the same rule (least served goes next; a
newcomer joins at the least of those waiting) to a different question, and is written apart on purpose:
it shares one engine's admissions between the batches it holds, equally, counting tokens as sequences are
admitted, and knows no tenants, weights, ranges or refunds; this shares every worker between tenants by
weight, charging estimates and correcting them when ranges end. The engine sits below the runtime (the
layers contract) and must not learn the runtime's words, and the runtime's policy is not the engine's: one
class for both would carry each side's half as options the other never sets.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

WEIGHTS_EVERY_S = 2.0


class FairShare:
    def __init__(self, weights: Callable[[], dict[str, float]] | None = None) -> None:
        self._weights_of = weights or dict
        self._weights: dict[str, float] = {}
        self._read_at = float("-inf")
        self.vtime: dict[str, float] = {}
        self.served: dict[str, int] = {}  # tokens of work charged per tenant, for operators
        self._turn: dict[str, int] = {}  # when each tenant was last served: ties go to the longest waiting
        self._clock = 0

    def weight(self, tenant: str) -> float:
        if time.monotonic() - self._read_at >= WEIGHTS_EVERY_S:
            self._weights, self._read_at = dict(self._weights_of()), time.monotonic()
        return self._weights.get(tenant, 1.0)

    def join(self, tenant: str, backlogged: Iterable[str]) -> None:
        """`tenant` has work queued again; `backlogged`: the tenants that had work queued already."""
        floor = min((self.vtime.get(t, 0.0) for t in backlogged if t != tenant), default=None)
        own = self.vtime.get(tenant, 0.0)
        self.vtime[tenant] = own if floor is None else max(own, floor)

    def pick(self, tenants: Iterable[str]) -> str:
        return min(tenants, key=lambda t: (self.vtime.get(t, 0.0), self._turn.get(t, -1), t))

    def charge(self, tenant: str, tokens: float) -> None:
        """Count `tokens` of work for `tenant` (negative: a correction or a refund)."""
        self.vtime[tenant] = self.vtime.get(tenant, 0.0) + tokens / self.weight(tenant)
        self.served[tenant] = self.served.get(tenant, 0) + int(tokens)
        if tokens > 0:
            self._turn[tenant] = self._clock
            self._clock += 1

    def shares(self) -> dict[str, dict]:
        """Per tenant: its weight and its share of the work charged so far (what an operator sees)."""
        total = sum(max(0, v) for v in self.served.values()) or 1
        return {
            t: {"weight": self.weight(t), "share": round(max(0, v) / total, 4)}
            for t, v in sorted(self.served.items())
        }
