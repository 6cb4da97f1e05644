"""`/v1/embeddings` batches through the real service and the openai client: `client.embeddings`-shaped lines
(strings, lists of strings, token lists), float and base64 vectors parsed by the SDK's own types, vectors equal
to sentence-transformers' `encode` of the served folder, `dimensions` honoured by a matryoshka model and
refused by name by any other, and every other field a named per-line 400 while the rest runs.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from openai.types import CreateEmbeddingResponse

from tests.support.service import (
    MODEL,
    Service,
    random_model,
    read_lines,
    settings_for,
    upload,
    wait_done,
    write_jsonl,
)

ST_MODEL = "tiny-st-mean"
TEXTS = ["the first text", "a second, rather longer text about embeddings " * 4, "é", "three"]


def row(custom_id: str, model: str = ST_MODEL, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": model, **body},
    }


@pytest.fixture(scope="module")
def st_path(tmp_path_factory):
    """The random test model's weights as a sentence-transformers folder: mean pooling, normalised, matryoshka."""
    import shutil

    from bulkgen.lab.tiny import add_sentence_transformers_config

    path = shutil.copytree(random_model(), tmp_path_factory.mktemp("st") / "model")
    return add_sentence_transformers_config(path, "mean", True, matryoshka=True)


@pytest.fixture(scope="module")
def client(tmp_path_factory, st_path):
    service = Service(
        settings_for(
            str(tmp_path_factory.mktemp("storage")),
            models={MODEL: str(random_model()), ST_MODEL: str(st_path)},
        )
    )
    yield service.client()
    service.stop()


def run_batch(client, rows, folder) -> tuple[dict, dict]:
    path = write_jsonl(folder / "in.jsonl", rows)
    batch = client.batches.create(
        input_file_id=upload(client, path).id, endpoint="/v1/embeddings", completion_window="24h"
    )
    batch = wait_done(client, batch.id, timeout=300)
    assert batch.status == "completed", batch
    output = {
        line["custom_id"]: sdk_parse(line["response"]["body"])
        for line in read_lines(client, batch.output_file_id)
    }
    errors = {
        line["custom_id"]: line["response"]["body"]["error"]
        for line in read_lines(client, batch.error_file_id)
    }
    assert batch.request_counts.completed == len(output) and batch.request_counts.failed == len(errors)
    return output, errors


def sdk_parse(body: dict) -> CreateEmbeddingResponse:
    """As `client.embeddings.create` reads a body: base64 vectors decoded to floats (np.frombuffer of little-endian
    float32), then the SDK's type. `encoding_format` is remembered on the result for the test to check."""
    encodings = {type(item["embedding"]).__name__ for item in body["data"]}
    for item in body["data"]:
        if isinstance(item["embedding"], str):
            item["embedding"] = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist()
    response = CreateEmbeddingResponse.model_validate(body)
    response.__dict__["wire"] = encodings
    return response


def vectors(response: CreateEmbeddingResponse) -> np.ndarray:
    """The vectors in input order."""
    return np.array(
        [item.embedding for item in sorted(response.data, key=lambda d: d.index)], dtype=np.float64
    )


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_embedding_lines_through_the_service(client, st_path, tmp_path):
    from sentence_transformers import SentenceTransformer

    from bulkgen.engine import Engine

    tokens = [[40, 41, 42, 43, 44], [7, 8]]
    rows = [
        row("one", input=TEXTS[0]),
        row("many", input=TEXTS, encoding_format="base64", user="someone"),
        row("many-float", input=TEXTS, encoding_format="float"),
        row("tokens", input=tokens[0]),
        row("token-lists", input=tokens, encoding_format="base64"),
        row("dims", input=TEXTS[:2], dimensions=16),
        row("bad-field", input="x", temperature=0),
        row("bad-format", input="x", encoding_format="int8"),
        row("bad-input", input=["x", 3]),
        row("too-many", input=["x"] * 2049),
        row("bad-token", input=[10**6]),
    ]
    output, errors = run_batch(client, rows, tmp_path)
    assert sorted(output) == ["dims", "many", "many-float", "one", "token-lists", "tokens"]
    assert {cid: e["param"] for cid, e in errors.items()} == {
        "bad-field": "body.temperature",
        "bad-format": "body.encoding_format",
        "bad-input": "body.input",
        "too-many": "body.input",
        "bad-token": "body.input",
    }
    reference = SentenceTransformer(str(st_path), device="cpu").encode(TEXTS).astype(np.float64)
    many = vectors(output["many"])
    assert output["many"].object == "list" and output["many"].model == ST_MODEL
    assert [d.object for d in output["many"].data] == ["embedding"] * 4
    assert cosines(many, reference).min() >= 0.9999
    assert output["many"].__dict__["wire"] == {"str"} and output["many-float"].__dict__["wire"] == {"list"}
    assert np.allclose(many, vectors(output["many-float"]), atol=1e-6)  # base64 is the float32 of the floats
    assert np.allclose(vectors(output["one"])[0], many[0], atol=1e-5)
    engine = Engine.from_pretrained(str(st_path))
    assert cosines(vectors(output["token-lists"]), np.array(engine.embed(tokens))).min() >= 0.9999
    assert cosines(vectors(output["tokens"]), np.array(engine.embed(tokens[:1]))).min() >= 0.9999
    assert output["token-lists"].usage.prompt_tokens == output["token-lists"].usage.total_tokens == 7
    dims = vectors(output["dims"])
    assert dims.shape == (2, 16) and np.allclose(np.linalg.norm(dims, axis=1), 1, atol=1e-5)
    truncated = reference[:2, :16] / np.linalg.norm(reference[:2, :16], axis=1, keepdims=True)
    assert cosines(dims, truncated).min() >= 0.9999


def test_dimensions_is_refused_by_a_model_not_trained_for_it(client, tmp_path):
    """The plain test model pools its last token (no sentence-transformers folder) and may not truncate."""
    output, errors = run_batch(
        client, [row("plain", MODEL, input=TEXTS), row("dims", MODEL, input="x", dimensions=8)], tmp_path
    )
    assert errors["dims"]["param"] == "body.dimensions" and "not supported" in errors["dims"]["message"]
    plain = vectors(output["plain"])
    assert plain.shape == (4, 128) and np.allclose(np.linalg.norm(plain, axis=1), 1, atol=1e-5)


def test_models_list_their_endpoints(client):
    models = {m.id: m for m in client.models.list()}
    assert "/v1/embeddings" in models[ST_MODEL].model_extra["endpoints"]


def test_the_body_fields_are_the_sdks():
    from openai.types import EmbeddingCreateParams

    from bulkgen.batch.endpoints import ENDPOINTS

    assert ENDPOINTS["/v1/embeddings"].fields == set(EmbeddingCreateParams.__annotations__)


@pytest.mark.parametrize(
    ("value", "inputs"),
    [("text", ["text"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_input_forms(value, inputs):
    from bulkgen.batch.requests import parse_line

    request = parse_line(_line(input=value), 1, "/v1/embeddings")
    assert (request.prompts or [request.prompt]) == inputs
    assert request.embedding == {"encoding_format": "float", "dimensions": None}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "body.input"),
        ({"input": []}, "body.input"),
        ({"input": [[]]}, "body.input"),
        ({"input": [True]}, "body.input"),
        ({"input": [[1], "a"]}, "body.input"),
        ({"input": [-1]}, "body.input"),
        ({"input": "x", "dimensions": 0}, "body.dimensions"),
        ({"input": "x", "dimensions": True}, "body.dimensions"),
        ({"input": "x", "user": 3}, "body.user"),
        ({"input": "x", "n": 2}, "body.n"),
    ],
)
def test_bad_bodies_name_their_field(body, param):
    from bulkgen.batch.requests import LineError, parse_line

    with pytest.raises(LineError) as err:
        parse_line(_line(**body), 1, "/v1/embeddings")
    assert err.value.param == param


def _line(**body) -> str:
    import json

    return json.dumps(row("c", **body))


def test_bulkgen_run_embeds_a_file_on_the_defaults(tmp_path):
    """`bulkgen run samples/embeddings.jsonl`: the bundled model (no sentence-transformers folder: last token,
    normalised), through the Ray workers this session already runs."""
    from click.testing import CliRunner

    from bulkgen.batch.resultfiles import parquet_row
    from bulkgen.cli import cli
    from tests.support.service import SAMPLES

    out = tmp_path / "emb.jsonl"
    result = CliRunner().invoke(
        cli,
        [
            "run",
            str(SAMPLES / "embeddings.jsonl"),
            "--output",
            str(out),
            "--storage",
            str(tmp_path / "store"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "10 completed, 0 failed" in result.output and "doc-0: 1 vector(s) of 256 values" in result.output
    import json

    lines = [json.loads(line) for line in out.read_text().splitlines()]
    bodies = {line["custom_id"]: sdk_parse(line["response"]["body"]) for line in lines}
    assert len(bodies["several"].data) == 2 and bodies["tokens"].usage.prompt_tokens == 5
    assert np.allclose(np.linalg.norm(vectors(bodies["doc-0"]), axis=1), 1, atol=1e-5)
    metrics = json.loads((tmp_path / "emb.metrics.json").read_text())
    assert metrics["requests"] == 11  # engine requests: one per input, so the two-input line counts twice
    assert (
        metrics["output_tokens"] == 0
        and metrics["input_tokens_per_s"] > 0
        and metrics["tpot_s"]["p50"] is None
    )
    row = parquet_row(lines[0])  # `bulkgen watch`'s export reads an embeddings line too
    assert row["status"] == "completed" and row["prompt_tokens"] > 0 and row["text"] is None
