"""A reasoning model's gate: a thinking-token budget, and a grammar that applies only after the reasoning.

A sequence's gate watches its generated tokens. Before the reasoning opens (the open sequence, e.g.
`<think>` or harmony's `<|channel|>analysis<|message|>`; at once when the prompt opened it) and during
it, every token is allowed. Once `budget` reasoning tokens were generated without the end (`</think>`,
`<|end|>`), the gate forces the end and the separator that leads to the answer (`\\n\\n`; harmony's
`<|start|>assistant<|channel|>final<|message|>`), one token per step (a mask with one allowed token,
vLLM's `thinking_token_budget`). After the end, the line's grammar (its inner matcher, if any) takes
over; a grammar's answer starts after the separator, which the gate forces too after an end the model
wrote itself, so the model's own whitespace never meets a JSON grammar that allows none.

It quacks like an llguidance matcher (consume_token, is_stopped, is_error, get_error), so the engine's
guided path (masks before sampling, consume after; overlapped steps included) drives it unchanged;
GrammarRuntime.masks fills its row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningSpec:
    """How one request's reasoning is delimited in token ids, and its budget (None: no budget)."""

    open_ids: tuple[int, ...]  # the generated sequence that opens the reasoning
    end_ids: tuple[int, ...]  # the sequence that ends it (forced when the budget is spent)
    answer_ids: tuple[int, ...] = ()  # what leads from the end to the answer (forced after the end)
    opened: bool = False  # the prompt opened the reasoning: the first generated token is in it
    budget: int | None = None

    def __post_init__(self) -> None:
        if not self.open_ids or not self.end_ids:
            raise ValueError("a reasoning spec needs its open and end token sequences")
        if self.budget is not None and (isinstance(self.budget, bool) or self.budget < 0):
            raise ValueError(f"thinking_token_budget must be a non-negative integer, not {self.budget!r}")


_BEFORE, _REASONING, _FORCING, _ANSWER = range(4)


class ReasoningGate:
    """One sequence's reasoning state in front of its grammar's matcher (`inner`, None: no grammar)."""

    def __init__(self, spec: ReasoningSpec, inner=None) -> None:
        self.spec, self.inner = spec, inner
        self.phase = _REASONING if spec.opened else _BEFORE
        self.spent = 0  # reasoning tokens generated
        self.forced: tuple[int, ...] = ()  # the tokens still to force, first next
        self._recent: list[int] = []  # the last generated tokens, to spot the open and end sequences
        self._error = ""  # a token other than the forced one was consumed (never, under the mask)

    def forced_token(self) -> int | None:
        """The only token the next step may sample, if the gate forces one."""
        if self.phase == _FORCING:
            return self.forced[0]
        if self.phase == _REASONING and self.spec.budget is not None and self.spent >= self.spec.budget:
            return self.spec.end_ids[0]
        return None

    def grammar(self):
        """The matcher that masks the next token now: the inner one once the answer has begun, and at the
        first token, where the model may answer at once instead of opening its reasoning (opening_token)."""
        return self.inner if self.phase == _ANSWER or self.opening_token() is not None else None

    def opening_token(self) -> int | None:
        """The open sequence's first token, allowed beside the grammar's own at the output's first token (a
        grammar's line whose model answers without reasoning is constrained from its first token)."""
        first = self.phase == _BEFORE and not self._recent and self.inner is not None
        return self.spec.open_ids[0] if first else None

    def consume_token(self, token: int) -> bool:
        if self.phase == _ANSWER:
            return True if self.inner is None else self.inner.consume_token(token)
        if self.phase == _REASONING and self.forced_token() is not None:  # the budget's end starts now
            self.phase, self.forced = _FORCING, self.spec.end_ids + self.spec.answer_ids
        if self.phase == _FORCING:
            if token != self.forced[0]:
                self._error = "a token other than the forced end of reasoning was sampled"
                return False
            self.forced = self.forced[1:]
            if not self.forced:
                self.phase = _ANSWER
            return True
        if self.opening_token() not in (None, token):  # an answer from the first token: the grammar's
            self.phase = _ANSWER
            return self.inner.consume_token(token)
        self._recent = (self._recent + [token])[-max(len(self.spec.open_ids), len(self.spec.end_ids)) :]
        if self.phase == _BEFORE:
            if self._ends_with(self.spec.open_ids):
                self.phase, self._recent = _REASONING, []
            return True
        self.spent += 1
        if self._ends_with(self.spec.end_ids):
            self._after_end()
        return True

    def _after_end(self) -> None:
        """The model wrote the end itself: the separator is forced only when a grammar follows."""
        if self.inner is not None and self.spec.answer_ids:
            self.phase, self.forced = _FORCING, self.spec.answer_ids
        else:
            self.phase = _ANSWER

    def _ends_with(self, ids: tuple[int, ...]) -> bool:
        return tuple(self._recent[-len(ids) :]) == ids

    def is_stopped(self) -> bool:
        return self.phase == _ANSWER and self.inner is not None and self.inner.is_stopped()

    def is_error(self) -> bool:
        return bool(self._error) or (self.inner is not None and self.inner.is_error())

    def get_error(self) -> str:
        return self._error or (self.inner.get_error() if self.inner is not None else "")
