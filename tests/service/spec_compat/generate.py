"""Generate the spec-compatibility corpus: one batch line per field and value of OpenAI's
CreateChatCompletionRequest and CreateCompletionRequest, each checked against the spec's own schema.

    python -m tests.service.spec_compat.generate path/to/openapi.json   (from github.com/openai/openai-openapi)

Writes, next to this file:
- request_schemas.json  the two request schemas and every component they use, as JSON Schema (OpenAPI's
                        `nullable` made `anyOf [..., null]`), so the test re-checks the corpus without the spec;
- chat.jsonl, completions.jsonl  the lines (custom_id: "<field>.<label>");
- expected.json         custom_id -> null (it runs) or the `param` of its 400 line.

Every field of the two schemas must have at least one case (the generator stops otherwise), so a field added
to the spec shows up here as a missing case.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.service.spec_compat.cases import CASES, base_body

HERE = Path(__file__).parent
SCHEMAS = {
    "/v1/chat/completions": "CreateChatCompletionRequest",
    "/v1/completions": "CreateCompletionRequest",
}
FILES = {"/v1/chat/completions": "chat.jsonl", "/v1/completions": "completions.jsonl"}
_DROP = {
    "description",
    "example",
    "examples",
    "x-oaiMeta",
    "title",
    "x-oaiExpandable",
    "discriminator",
    "x-oaiTypeLabel",
    "x-stainless-const",
    "deprecated",
}


def json_schemas(spec: dict) -> dict:
    """{"$defs": {name: schema}} for the two requests and what they reference, in JSON Schema terms."""
    components = spec["components"]["schemas"]
    defs: dict[str, dict] = {}

    def convert(node):
        if isinstance(node, list):
            return [convert(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: convert(v) for k, v in node.items() if k not in _DROP}
        ref = out.get("$ref")
        if ref:
            name = ref.rsplit("/", 1)[-1]
            out["$ref"] = f"#/$defs/{name}"
            if name not in defs:
                defs[name] = {}
                defs[name] = convert(components[name])
        if out.pop("nullable", False):
            return {"anyOf": [out, {"type": "null"}]}
        return out

    for name in SCHEMAS.values():
        defs[name] = convert(components[name])
    return {"$defs": defs}


def properties(schemas: dict, name: str) -> set[str]:
    """The body fields of a request schema (its own properties and those of every allOf part)."""
    node, out = schemas["$defs"][name], set()
    for part in node.get("allOf", [node]):
        if "$ref" in part:
            out |= properties(schemas, part["$ref"].rsplit("/", 1)[-1])
        out |= set(part.get("properties", {}))
    return out


def validator(schemas: dict, name: str):
    import jsonschema

    return jsonschema.Draft202012Validator({**schemas, "$ref": f"#/$defs/{name}"})


def lines(endpoint: str, schemas: dict) -> tuple[list[dict], dict[str, str | None]]:
    fields = properties(schemas, SCHEMAS[endpoint])
    cases = CASES[endpoint]
    missing = fields - {field for field, *_ in cases}
    if missing:
        raise SystemExit(f"{endpoint}: no case for the spec fields {sorted(missing)}")
    check = validator(schemas, SCHEMAS[endpoint])
    rows, expected = [], {}
    for field, label, change, refused in cases:
        if field not in fields:
            raise SystemExit(f"{endpoint}: {field} is not a field of {SCHEMAS[endpoint]}")
        body = {**base_body(endpoint), **change}
        errors = sorted(check.iter_errors(body), key=str)
        if errors:
            raise SystemExit(
                f"{endpoint} {field}.{label} is not valid for the spec: {errors[0].message[:300]}"
            )
        custom_id = f"{field}.{label}"
        rows.append({"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body})
        expected[custom_id] = refused
    return rows, expected


def main(spec_path: str) -> None:
    schemas = json_schemas(json.loads(Path(spec_path).read_text()))
    (HERE / "request_schemas.json").write_text(json.dumps(schemas, indent=1, sort_keys=True) + "\n")
    expected: dict[str, dict] = {}
    for endpoint, filename in FILES.items():
        rows, expected[endpoint] = lines(endpoint, schemas)
        (HERE / filename).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    counts = {
        e: (sum(v is None for v in x.values()), sum(v is not None for v in x.values()))
        for e, x in expected.items()
    }
    print(json.dumps(counts))


if __name__ == "__main__":
    main(sys.argv[1])
