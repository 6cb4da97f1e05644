"""JSON schemas shared by the engine's and the service's tests: ones no document can come out of, and one an
image-labelling line asks for."""

from __future__ import annotations

# A schema whose grammar fails only as a document is written: its pattern (past llguidance's lexer limits)
# sits behind a `$ref`, after a property whose long name takes the first steps, so it passes the compiler's
# first steps (bulkgen/engine/features/schema_compiler.py) and fails in the engine, where the value begins.
LATE_FAILURE = {
    "$defs": {"bad": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
    "type": "object",
    "properties": {
        "a_flag_whose_long_name_takes_the_first_steps_of_the_document_x": {"type": "boolean"},
        "z": {"$ref": "#/$defs/bad"},
    },
    "required": ["a_flag_whose_long_name_takes_the_first_steps_of_the_document_x", "z"],
    "additionalProperties": False,
}

# 7,000 optional patterned properties (about 480 KB, under the size limit): seconds to compile (on 2 busy
# cores, more than the time limit), and more alternatives than llguidance's parser takes in one row
SLOW_TO_COMPILE = {
    "type": "object",
    "properties": {
        f"p{i}": {"type": "string", "pattern": f"^(a|b|c)*{i}[a-z]{{0,20}}$"} for i in range(7000)
    },
}


def ref_chain(length: int) -> dict:
    """`length` objects each reaching the next through a `$ref` (1,000 overflow llguidance's stack)."""
    defs = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(length)
    }
    return {"$defs": {**defs, f"d{length}": {"type": "string"}}, "$ref": "#/$defs/d0"}


# what an image-labelling line asks for: tests of structured outputs with images (engine and service)
ANIMAL = {
    "type": "object",
    "properties": {
        "label": {"enum": ["cat", "dog", "bird"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["label", "count"],
    "additionalProperties": False,
}
