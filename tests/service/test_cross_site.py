"""A keyless service against a web page on another site: what it refuses (Host, Origin, content type), the
security headers on every answer, and the fields it refuses rather than ignore."""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from bulkgen.store import LocalStore
from tests.service.api_only import ApiOnly

JSONL = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


@pytest.fixture
def api(tmp_path):
    server = ApiOnly(
        LocalStore(tmp_path / "storage", fsync=False),
        app_options={"allowed_hosts": ["bulkgen.test", ".corp.example"]},
    )
    yield server
    server.stop()


def _request(
    api, method: str, path: str, body: bytes | None = None, **headers: str
) -> http.client.HTTPResponse:
    """A request with exactly these headers (Host included, when given), as a browser or a script sends it;
    the response's body is read into `.data`."""
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=30)
    names = {k.replace("_", "-"): v for k, v in headers.items()}
    conn.putrequest(method, path, skip_host="Host" in names)
    for name, value in names.items():
        conn.putheader(name, value)
    conn.putheader("Content-Length", str(len(body or b"")))
    conn.endheaders(body)
    response = conn.getresponse()
    response.data = response.read()
    conn.close()
    return response


def _form(fields: dict[str, str], boundary: str = "xyz") -> tuple[bytes, str]:
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'
        for k, v in fields.items()
    ]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n')
    body = "".join(parts).encode() + JSONL + f"\r\n--{boundary}--\r\n".encode()
    return body, f"multipart/form-data; boundary={boundary}"


def test_json_routes_refuse_a_body_that_is_not_sent_as_json(api):
    file_id = api.client().files.create(file=("a.jsonl", JSONL), purpose="batch").id
    body = f'{{"input_file_id": "{file_id}", "endpoint": "/v1/chat/completions"}}'.encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content_Type": content_type} if content_type else {}
        response = _request(api, "POST", "/v1/batches", body, **headers)
        error = json.loads(response.data)["error"]
        assert response.status == 415 and error["code"] == "unsupported_media_type", content_type
        assert "application/json" in error["message"]
    assert api.client().batches.list().data == []  # nothing was created
    batch = api.client().batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )  # the SDK sends application/json
    assert batch.status == "validating"


def test_writes_from_another_origin_are_refused(api):
    body, content_type = _form({"purpose": "batch"})
    own = f"http://127.0.0.1:{api.port}"
    for origin in (
        "http://evil.example",
        "null",
        "http://[",
        f"http://localhost:{api.port}",
        f"https://127.0.0.1:{api.port}1",
    ):
        response = _request(api, "POST", "/v1/files", body, Content_Type=content_type, Origin=origin)
        assert response.status == 403 and json.loads(response.data)["error"]["code"] == "cross_origin_refused"
    assert api.client().files.list().data == []
    response = _request(api, "POST", "/v1/files", body, Content_Type=content_type, Origin=own)
    assert response.status == 200  # the dashboard's own page
    (stored,) = api.client().files.list().data
    assert _request(api, "DELETE", f"/v1/files/{stored.id}", Origin="http://evil.example").status == 403
    assert (
        _request(api, "GET", f"/v1/files/{stored.id}", Origin="http://evil.example").status == 200
    )  # reads: CORS
    assert _request(api, "DELETE", f"/v1/files/{stored.id}", Origin=own).status == 200


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("127.0.0.1:{port}", 200),
        ("localhost:{port}", 200),
        ("[::1]:{port}", 200),
        ("LOCALHOST:{port}", 200),
        ("bulkgen.test", 200),
        ("bulkgen.test:8443", 200),  # --allowed-hosts: any port
        ("evil.example:{port}", 400),
        ("127.0.0.1:1{port}", 400),
        ("127.0.0.1", 400),
        ("", 400),
        ("bulkgen.test.evil.example", 400),
        ("api.corp.example", 200),
        ("corp.example:8000", 200),
        ("evilcorp.example", 400),
    ],
)
def test_the_host_header_must_name_this_service(api, host, status):
    response = _request(api, "GET", "/v1/files", Host=host.format(port=api.port))
    assert response.status == status
    if status == 400:
        assert json.loads(response.data)["error"]["code"] == "invalid_host"


def test_any_host_is_answered_with_a_star(tmp_path):
    server = ApiOnly(LocalStore(tmp_path / "s", fsync=False), app_options={"allowed_hosts": ["*"]})
    try:
        assert _request(server, "GET", "/v1/files", Host="anything.example").status == 200
    finally:
        server.stop()


@pytest.mark.parametrize(
    "path", ["/", "/ui/app.js", "/v1/files", "/v1/files/file-nope", "/health", "/openapi.json"]
)
def test_every_answer_carries_security_headers(api, path):
    response = _request(api, "GET", path)
    csp = response.getheader("Content-Security-Policy")
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert response.getheader("X-Frame-Options") == "DENY"
    assert response.getheader("X-Content-Type-Options") == "nosniff"
    assert response.getheader("Referrer-Policy") == "no-referrer"
    refused = _request(api, "GET", path, Host="evil.example")
    assert refused.status == 400 and refused.getheader("X-Frame-Options") == "DENY"


def test_no_swagger_page_from_a_cdn_and_the_openapi_document_stays(api):
    assert _request(api, "GET", "/docs").status == 404
    assert _request(api, "GET", "/openapi.json").status == 200


def test_unknown_upload_fields_are_refused_by_name(api):
    body, content_type = _form(
        {"purpose": "batch", "expires_after": '{"anchor": "created_at", "seconds": 3600}'}
    )
    response = _request(api, "POST", "/v1/files", body, Content_Type=content_type)
    error = json.loads(response.data)["error"]
    assert (
        response.status == 400 and error["param"] == "expires_after" and error["code"] == "unknown_parameter"
    )
    assert "'expires_after'" in error["message"]
    assert list(api.svc.store.list("files/")) == []  # the file part was stored, then discarded
    file = api.client().files.create(
        file=("a.jsonl", JSONL), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    assert file.expires_at == file.created_at + 3600  # the known bracketed fields still work


@pytest.mark.parametrize(
    ("expiry", "param"),
    [
        ({"anchor": "created_at"}, "output_expires_after.seconds"),
        ({"seconds": 3600}, "output_expires_after.anchor"),
        ({"anchor": "created_at", "seconds": 3600, "days": 1}, "output_expires_after.days"),
    ],
)
def test_output_expires_after_needs_exactly_anchor_and_seconds(api, expiry, param):
    file_id = api.client().files.create(file=("a.jsonl", JSONL), purpose="batch").id
    with pytest.raises(openai.BadRequestError) as info:
        api.client().batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"output_expires_after": expiry},
        )
    assert info.value.param == param
    assert api.client().batches.list().data == []
