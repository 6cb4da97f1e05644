"""What a constrained request's output must be (`Guide`) and whether its schema compiles (`check`): the
half of constrained decoding that needs no model and no torch, so the API and the parser validate
requests without loading either (grammar.py holds the engine's half: matchers and masks)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from bulkgen.engine.features.schema_compiler import LIMITS, GrammarError, compile_schema, reason

__all__ = ["KINDS", "GrammarError", "Guide", "check", "compile_guide", "grammar"]

KINDS = ("json_schema", "json_object", "lark")


@dataclass(frozen=True)
class Guide:
    """What a request's output must be: `kind` "json_object" (any JSON object), "json_schema" (`schema`:
    the schema as compact JSON text, so equal schemas share one compiled grammar; keys keep their order,
    which is the order properties are written in) or "lark" (`schema`: an llguidance lark grammar, such as
    a forced tool call in a model's own call syntax, bulkgen.batch.forced_syntax)."""

    kind: str
    schema: str = ""

    @classmethod
    def json_schema(cls, schema: dict | bool) -> Guide:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> Guide:
        return cls("json_object")

    @classmethod
    def lark(cls, grammar_text: str) -> Guide:
        return cls("lark", grammar_text)


def check(guide: Guide) -> None:
    """Raise GrammarError (with the compiler's reason) if `guide` cannot be compiled; needs no model."""
    grammar(guide)


def grammar(guide: Guide) -> str:
    """The compiled grammar of `guide`; GrammarError with the reason it has none."""
    compiled, refusal = compile_guide(guide)
    if refusal:
        raise GrammarError(refusal)
    return compiled


@lru_cache(maxsize=1024)
def compile_guide(guide: Guide) -> tuple[str, str]:
    """(grammar, "") or ("", why not), once per distinct schema per process: a refusal is kept too, so a
    file repeating a schema that crashes the compiler or runs out of time costs that once."""
    if guide.kind not in KINDS:
        return "", f"unknown constraint kind {guide.kind!r}; expected one of {KINDS}"
    try:
        if guide.kind == "lark":
            return _compile_lark(guide.schema), ""
        return compile_schema(guide.schema if guide.kind == "json_schema" else None), ""
    except GrammarError as exc:
        return "", str(exc)


def _compile_lark(text: str) -> str:
    """A lark grammar this process wrote (not a user's schema: no helper process needed), checked."""
    import llguidance

    try:
        compiled = llguidance.grammar_from("lark", text)
    except ValueError as exc:
        raise GrammarError(reason(str(exc))) from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        compiled, limits=llguidance.LLParserLimits(**LIMITS)
    )
    if is_error:
        raise GrammarError(reason("; ".join(messages)))
    return compiled
