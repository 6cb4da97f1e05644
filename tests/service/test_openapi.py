"""The service's own /openapi.json describes it: schemathesis (through its Python API) generates requests
from the description against a live service (real uvicorn on 127.0.0.1, an API key required) and checks
each answer: a documented status, a body that matches the documented schema and media type, no 5xx,
schema-valid data accepted and invalid data refused, the key enforced.

Bounded and repeatable: MAX_EXAMPLES per operation and mode, derandomized (the same requests every run);
about 10 s on 2 cores.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import positive_data_acceptance

from bulkgen.store import LocalStore
from tests.service.api_only import ApiOnly

KEY = "schema-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_EXAMPLES = 25
# Whether a batch's input file exists is no part of a request's shape: a create naming a file that is
# not there is a 400 naming input_file_id (as bulkgen.batch.service answers), which that check would
# count as schema-valid data refused.
NOT_FROM_THE_SCHEMA = {"POST /v1/batches": [positive_data_acceptance]}


ROUTES = {
    "POST /v1/files",
    "GET /v1/files",
    "GET /v1/files/{file_id}",
    "DELETE /v1/files/{file_id}",
    "GET /v1/files/{file_id}/content",
    "POST /v1/batches",
    "GET /v1/batches",
    "GET /v1/batches/{batch_id}",
    "POST /v1/batches/{batch_id}/cancel",
    "POST /v1/batches/{batch_id}/retry",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "GET /v1/dashboard/workers",
    "GET /v1/dashboard/batches/{batch_id}/timeline",
    "GET /health",
    "GET /metrics",
}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    server = ApiOnly(
        LocalStore(tmp_path_factory.mktemp("openapi") / "storage", fsync=False), app_options={"api_key": KEY}
    )
    yield server
    server.stop()


def _schema(api):
    # Unknown query parameters are ignored, as OpenAI ignores them (Azure clients send `api-version`):
    # requests that add some are not requests the description refuses.
    config = schemathesis.Config.from_dict(
        {"generation": {"allow-extra-parameters": False, "deterministic": True}}
    )
    return schemathesis.openapi.from_url(f"{api.root}/openapi.json", headers=AUTH, config=config)


def test_the_description_is_the_service(api):
    spec = _schema(api).raw_schema
    documented = {f"{m.upper()} {p}" for p, ops in spec["paths"].items() for m in ops}
    assert documented == ROUTES  # docs/service.md's table, but for the dashboard's page and assets
    statuses = {s for ops in spec["paths"].values() for op in ops.values() for s in op["responses"]}
    assert "422" not in statuses and {"400", "401", "404", "408", "409", "413", "415", "503"} <= statuses
    assert spec["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": spec["components"]["securitySchemes"]["bearer"]["description"],
    }
    assert spec["security"] == [{"bearer": []}] and spec["paths"]["/health"]["get"]["security"] == []
    upload = spec["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert upload["required"] == ["file", "purpose"] and upload["additionalProperties"] is False
    create = spec["paths"]["/v1/batches"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert create == {"$ref": "#/components/schemas/CreateBatch"}
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


def test_schemathesis_finds_no_mismatch(api):
    failures = []
    for result in _schema(api).get_all_operations():
        operation = result.ok()
        modes = [GenerationMode.POSITIVE]
        if operation.path_parameters or operation.query or operation.body:  # something to get wrong
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            try:
                _run(operation, mode)
            except FailureGroup as exc:  # names each failed check, with a curl line to replay it
                failures.append(f"{operation.label} ({mode.value}):\n{exc}")
            except Unsatisfiable:  # a path parameter any string fits: no invalid value to send
                assert mode == GenerationMode.NEGATIVE, operation.label
    assert not failures, "\n\n".join(failures)


def _run(operation, mode: GenerationMode) -> None:
    excluded = NOT_FROM_THE_SCHEMA.get(operation.label, [])

    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case) -> None:
        case.call_and_validate(headers=AUTH, excluded_checks=excluded)

    check()
