"""Fuzz: any JSON value in any body field yields a request the worker path accepts (chat template, tokenize,
fit the context, SamplingParams) or that line's LineError naming the field; never another exception, and
never a failure of the whole file (validation and the line index take every line)."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bulkgen.batch.bodyfields import BODY_FIELDS
from bulkgen.batch.prepare import fit_context, tokenize
from bulkgen.batch.requests import CHAT, COMPLETIONS, LineError, parse_line
from bulkgen.batch.validate import Validator, validate_stream
from bulkgen.engine.sampling.sampling_params import SamplingParams
from bulkgen.lab.tiny import build_tokenizer
from bulkgen.runtime.lineindex import IndexBuilder
from tests.support.service import HERMES_TEMPLATE, MODEL, chat_row, completion_row

TOKENIZER = build_tokenizer()
TOKENIZER.chat_template = HERMES_TEMPLATE
MAX_MODEL_LEN = 4096

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["auto", "none", "text", "required", "function", "user", "0", "-1", "1e3"])
)
# The values where limits lie (drawn half the time, so every field meets them within a few hundred examples).
EDGES = st.sampled_from(
    [
        0,
        1,
        -1,
        0.5,
        2,
        -2,
        2.5,
        5,
        20,
        21,
        128,
        129,
        4096,
        2**63 - 1,
        2**63,
        -(2**63),
        2**64,
        None,
        True,
        "",
        {},
        [],
        {"1": 5},
        {"300": -100},
        [[1, 2]],
        [1, 2],
    ]
)
JSON = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["type", "name", "text", "role", "content", "function", "arguments", "0", "7"])
            | st.text(max_size=6),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)


def _line(endpoint: str, field: str, value) -> str:
    row = chat_row("f", "hi") if endpoint == CHAT else completion_row("f", "hi")
    row["body"][field] = value
    return json.dumps(row)


def _run_like_a_worker(raw: str, endpoint: str, field: str) -> None:
    try:
        request = parse_line(raw, 1, endpoint)
        ids = tokenize(request, TOKENIZER)
        SamplingParams(**fit_context(request, len(ids), MAX_MODEL_LEN))
    except LineError as err:
        assert err.param is not None and (
            err.param == f"body.{field}"
            or err.param.startswith((f"body.{field}[", f"body.{field}."))
            or err.code == "context_length_exceeded"
        ), (err.param, err.message)
        assert len(err.message) < 400


def _validate_and_index(raw: str, endpoint: str) -> None:
    builder = IndexBuilder()
    result = validate_stream(io.BytesIO(raw.encode() + b"\n"), Validator(endpoint, [MODEL], 10), builder.add)
    assert (
        result.ok
        or [e["code"] for e in result.errors] == ["missing_model"]
        or [e["code"] for e in result.errors] == ["model_not_found"]
    )
    builder.build()


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_json_value_in_any_body_field(endpoint, data):
    field = data.draw(st.sampled_from(sorted(BODY_FIELDS[endpoint] - {"model"})), label="field")
    value = data.draw(EDGES | JSON, label="value")
    raw = _line(endpoint, field, value)
    _run_like_a_worker(raw, endpoint, field)
    _validate_and_index(raw, endpoint)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_model_value_fails_only_the_file(endpoint, data):
    """body.model is the file's business (one served model per file): anything else is a file error."""
    raw = _line(endpoint, "model", data.draw(JSON))
    _validate_and_index(raw, endpoint)
