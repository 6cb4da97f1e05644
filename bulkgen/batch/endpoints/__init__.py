"""The endpoints a batch line may name, one module each: what is particular to an endpoint lives in its
module (the body parsed into a ParsedRequest, its sampling mapping, the body field its prompt comes from
and how it fits the context, and the response body shaped from the worker's result), as an `Endpoint`.

Shared code looks the line's url up in `ENDPOINTS` once and never branches on it (tests/service/
test_endpoints.py holds that). The parts endpoints share stay where they are and are called from here:
body field checks (bulkgen.batch.bodyfields), messages, tools, structured outputs, reasoning, sampling's
field rules. Adding an endpoint is a module here (its body's fields, its extensions, parse and answer) and its
line in `ENDPOINTS`, plus its url in schema.ENDPOINTS (the list the API accepts).
"""

from __future__ import annotations

from bulkgen.batch.endpoints import chat, completions, embeddings, responses
from bulkgen.batch.endpoints.base import Endpoint

__all__ = ["ENDPOINTS", "Endpoint"]

ENDPOINTS: dict[str, Endpoint] = {
    e.url: e for e in (chat.ENDPOINT, completions.ENDPOINT, responses.ENDPOINT, embeddings.ENDPOINT)
}
