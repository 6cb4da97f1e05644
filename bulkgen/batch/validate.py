"""Validate a whole input file before any work starts, listing every problem with its line."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from bulkgen.batch.requests import LineError, parse_line

MAX_LISTED_ERRORS = 1000


@dataclass
class ValidationResult:
    total: int = 0
    model: str | None = None
    errors: list[dict] = field(default_factory=list)
    error_count: int = 0

    @property
    def ok(self) -> bool:
        return self.error_count == 0

    def add(self, code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_LISTED_ERRORS:
            self.errors.append({"code": code, "line": line, "message": message, "param": param})

    def error_list(self) -> dict:
        """The batch object's `errors` field."""
        data = list(self.errors)
        if self.error_count > len(self.errors):
            more = self.error_count - len(self.errors)
            data.append({"code": "too_many_errors", "line": None, "param": None,
                         "message": f"{more} more errors not listed; fix the ones above and validate again"})
        return {"object": "list", "data": data}


def validate_lines(
    lines: Iterable[bytes], endpoint: str, served_models: Iterable[str], max_requests: int
) -> ValidationResult:
    """Check every line; `served_models` are the names this deployment can run."""
    result = ValidationResult()
    first_line: dict[str, int] = {}
    served = set(served_models)
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        result.total += 1
        try:
            request = parse_line(raw, number, endpoint)
        except LineError as err:
            result.add(err.code, err.message, number, err.param)
            continue
        _check_identity(result, request, number, first_line, served)
    _check_file(result, max_requests)
    return result


def _check_identity(result: ValidationResult, request, number: int, first_line: dict, served: set) -> None:
    if request.custom_id in first_line:
        result.add("duplicate_custom_id",
                   f"custom_id {request.custom_id!r} already used on line {first_line[request.custom_id]}",
                   number, "custom_id")
    else:
        first_line[request.custom_id] = number
    if result.model is None:
        result.model = request.model
        if request.model not in served:
            result.add("model_not_found",
                       f"model {request.model!r} is not served here; available: {sorted(served)}",
                       number, "body.model")
    elif request.model != result.model:
        result.add("model_mismatch",
                   f"model {request.model!r} differs from {result.model!r}; one model per file",
                   number, "body.model")


def _check_file(result: ValidationResult, max_requests: int) -> None:
    if result.total == 0:
        result.add("empty_file", "the input file has no requests")
    elif result.total > max_requests:
        result.add("too_many_tasks",
                   f"the file has {result.total} requests; the limit per batch is {max_requests} "
                   "(split the file, or raise --max-requests-per-batch)")
