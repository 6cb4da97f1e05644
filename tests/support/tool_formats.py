"""What the tool-format tests share: the real chat templates and the tools they call."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"


def function_tool(name: str, properties: dict, required: tuple[str, ...] = (), closed: bool = True) -> dict:
    """A function tool whose `parameters` declare `properties` (`closed`: no other keys allowed)."""
    parameters: dict = {"type": "object", "properties": properties, "required": list(required)}
    if closed:
        parameters["additionalProperties"] = False
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# A tool a forced call can finish on a random model: every value is bounded.
BOUNDED_WEATHER = function_tool(
    "get_weather",
    {
        "city": {"type": "string", "enum": ["Oslo", "Zürich"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "metric": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6},
    },
    ("city", "days"),
)
