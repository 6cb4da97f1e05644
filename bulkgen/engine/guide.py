"""What a constrained request's output must be (`Guide`) and whether its schema compiles (`check`): the
half of constrained decoding that needs no model and no torch, so the API and the parser validate
requests without loading either (grammar.py holds the engine's half: matchers and masks)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from .schema_compiler import GrammarError, compile_schema

__all__ = ["KINDS", "GrammarError", "Guide", "check", "compile_guide", "grammar"]

KINDS = ("json_schema", "json_object")


@dataclass(frozen=True)
class Guide:
    """What a request's output must be: `kind` "json_object" (any JSON object) or "json_schema"
    (`schema`: the schema as compact JSON text, so equal schemas share one compiled grammar; keys keep
    their order, which is the order properties are written in)."""

    kind: str
    schema: str = ""

    @classmethod
    def json_schema(cls, schema: dict | bool) -> Guide:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> Guide:
        return cls("json_object")


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
        return compile_schema(guide.schema if guide.kind == "json_schema" else None), ""
    except GrammarError as exc:
        return "", str(exc)
