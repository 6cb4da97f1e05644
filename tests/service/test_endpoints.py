"""The endpoint registry (bulkgen.batch.endpoints, no server): it covers exactly the endpoints the API
accepts, each module parses its line and shapes its answer, and no module outside it branches on a url."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from bulkgen.batch.bodyfields import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES
from bulkgen.batch.endpoints import ENDPOINTS
from bulkgen.batch.outputlines import success_line
from bulkgen.batch.requests import parse_line
from bulkgen.batch.schema import ENDPOINTS as ACCEPTED
from tests.support.service import MODEL

PACKAGE = Path(__file__).resolve().parents[2] / "bulkgen"
URL_NAMES = {"CHAT", "COMPLETIONS", "RESPONSES", "EMBEDDINGS"}  # bulkgen.batch.bodyfields' url constants
URLS = {CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS}
URLS |= {url.removeprefix("/v1") for url in URLS}  # the unversioned form the API takes too (schema.versioned)


def test_the_registry_covers_exactly_the_endpoints_the_api_accepts():
    assert list(ENDPOINTS) == list(ACCEPTED)  # the batch API's four, in the order its errors list them
    assert all(endpoint.fields for endpoint in ENDPOINTS.values())  # and each has its body's field list
    assert all(endpoint.url == url for url, endpoint in ENDPOINTS.items())


# The worker's finished-request dict (bulkgen.runtime.worker.result_dict), as little of it as the bodies read.
RESULT = {
    "completions": [{"index": 0, "text": "hi", "finish_reason": "stop", "embedding": [0.5, 0.25]}],
    "prompt_tokens": 3,
    "completion_tokens": 1,
}
ANSWERS = {CHAT: "chat.completion", COMPLETIONS: "text_completion", RESPONSES: "response", EMBEDDINGS: "list"}


@pytest.mark.parametrize("url", list(ENDPOINTS))
def test_each_endpoint_parses_its_sample_body_and_answers_in_its_own_shape(url):
    body = {"model": MODEL, **ENDPOINTS[url].sample_input}
    raw = json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body})
    request = parse_line(raw, 1, url)
    assert request.endpoint == url
    line = success_line(request, RESULT, MODEL)
    assert line["custom_id"] == "a"
    assert line["response"]["body"]["object"] == ANSWERS[url]


def url_comparisons(root: Path) -> list[str]:
    """Every comparison with an endpoint's url (a literal, or one of bodyfields' constants) in the modules
    under `root` outside its `batch/endpoints/`: the `if endpoint == ...` chains the registry replaced."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if "endpoints" in path.relative_to(root).parts[:2]:
            continue
        tree = ast.parse(path.read_text(), str(path))
        lines = sorted(
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Compare) and any(_names_url(o) for o in (node.left, *node.comparators))
        )
        found += [f"{path.relative_to(root.parent)}:{line}" for line in lines]
    return found


def _names_url(node: ast.AST) -> bool:
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_url(e) for e in node.elts)
    if isinstance(node, ast.Constant):
        return node.value in URLS
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name in URL_NAMES


def test_no_module_outside_the_endpoints_package_branches_on_a_url():
    assert url_comparisons(PACKAGE) == []


def test_the_url_check_finds_a_url_chain(tmp_path):
    """The check above can fail: the chains it forbids, as they were written, are found."""
    (tmp_path / "batch").mkdir()
    (tmp_path / "batch" / "outputlines.py").write_text(
        "if request.endpoint == EMBEDDINGS:\n    pass\n"
        "names = 'top_logprobs' if endpoint == bodyfields.CHAT else 'logprobs'\n"
        "where = 'body.input' if url in ('/v1/embeddings', '/v1/responses') else 'body.prompt'\n"
        "if endpoint != '/embeddings':\n    pass\n"
    )
    (tmp_path / "batch" / "endpoints").mkdir()
    # an endpoint's own module may compare with its url
    (tmp_path / "batch" / "endpoints" / "chat.py").write_text("if url == CHAT:\n    pass\n")
    assert url_comparisons(tmp_path) == [f"{tmp_path.name}/batch/outputlines.py:{n}" for n in (1, 3, 4, 5)]
