"""Shared pytest fixtures."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# Without a GPU, triton kernels (bulkgen/engine/attention/triton_decode.py) run in triton's CPU interpreter. It is
# chosen when triton.language is first imported, so it is set here, before any test imports bulkgen.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every engine a worker builds is the held engine (tests/support/held_engine.py): it behaves as the plain one
# except for requests marked HOLD while a test keeps the gate closed. Set at import, before anything starts
# Ray or a subprocess, so every worker process inherits both variables.
os.environ["BULKGEN_TEST_ENGINE"] = "tests.support.held_engine:HeldEngine"
# and every tensor-parallel follower the held rank (tests/support/held_rank.py), whose load a test can hold
os.environ["BULKGEN_TEST_RANK_ACTOR"] = "tests.support.held_rank:HeldRankActor"
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
)  # to import it
os.environ["BULKGEN_TEST_GATE"] = tempfile.mkdtemp(prefix="bulkgen-gate-")
atexit.register(shutil.rmtree, os.environ["BULKGEN_TEST_GATE"], ignore_errors=True)


@pytest.fixture
def engine_gate():
    """The held engine's gate (tests/support/held_engine.py), closed for the test and opened again when it
    ends, so a failed test never leaves the next one's requests held."""
    from tests.support.held_engine import EngineGate

    gate = EngineGate(os.environ["BULKGEN_TEST_GATE"])
    gate.close()
    yield gate
    gate.open()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(arch, seed=..., builder=..., **config)`: the folder of a tiny model built once per test
    session (tests/support/tiny_models.py); shared, so read only."""
    from tests.support.tiny_models import TinyModels

    return TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def vlm_path(tiny_model):
    """A tiny LLaVA (bulkgen.lab.tiny_vision) for the tests that send images: the service's, the planner's,
    the worker's and the engine's."""
    from bulkgen.lab.tiny_vision import build_tiny_vlm

    return tiny_model("llava", seed=3, builder=build_tiny_vlm)


# ---- object storage: moto S3 server over real HTTP (owner: store) ------------------------------
# `s3_server` (session): endpoint URL of a moto ThreadedMotoServer on 127.0.0.1 with fake credentials.
# `s3_bucket_url` (function): "s3://<fresh bucket>/prefix", with AWS_ENDPOINT_URL set for subprocesses.

_FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session", autouse=True)
def aws_test_credentials():
    """Fake credentials and region for every S3 server the tests start (never real AWS). Autouse, so
    they are set before any test starts Ray: worker processes inherit the environment of that moment."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _FAKE_AWS_ENV.items():
            mp.setenv(name, value)
        for name in ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE"):  # SeaweedFS rejects a token
            mp.delenv(name, raising=False)
        yield


@pytest.fixture(scope="session")
def s3_server(aws_test_credentials):
    """A real S3 endpoint (moto) on 127.0.0.1; yields its URL, e.g. 'http://127.0.0.1:40123'."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_bucket_url(s3_server, monkeypatch):
    """A fresh, empty bucket; AWS_ENDPOINT_URL points at the server so subprocesses and Ray workers find it."""
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    bucket = f"test-{uuid.uuid4().hex[:20]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/prefix"


@pytest.fixture
def flaky_proxy(s3_server):
    """A fault-injecting proxy in front of the S3 server (tests/store/conftest.py FlakyProxy): its `.url`
    is the endpoint to use; set `.rate` or `.down` to inject faults."""
    from tests.support.s3 import FlakyProxy

    proxy = FlakyProxy(s3_server)
    proxy.thread.start()
    yield proxy
    proxy.server.shutdown()
    proxy.server.server_close()


# ---- end of object storage fixtures ----------------------------------------------------------------


# ---- one bulkgen service per test session (uvicorn + local Ray in this process), shared by tests/service
# and tests/runtime: Ray runs once per process and worker actors are named, so there is only one.


@pytest.fixture(scope="session")
def service(tmp_path_factory, aws_test_credentials):
    from tests.support.service import Service, settings_for

    svc = Service(
        settings_for(
            str(tmp_path_factory.mktemp("storage")), max_requests_per_batch=500, fair_share_after_s=2.0
        )
    )
    yield svc
    svc.stop()


@pytest.fixture
def client(service):
    return service.client()


# ---- the tiers (tests/support/tiers.py): each test is marked with what it starts (`ray`, `server`,
# `subprocess`), and `fast` when it starts none of them and is not `slow`: `python -m pytest -m fast` is the
# edit-test tier. A fast test that starts Ray, a uvicorn server or a subprocess fails (`fast_tier_guard`),
# so the tier stays what it says whatever a later test does.


def pytest_collection_modifyitems(config, items):
    from tests.support.tiers import STARTS, tier_marks

    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        defs = fixtures.name2fixturedefs if fixtures else {}
        functions = [getattr(item, "function", None)] + [d.func for ds in defs.values() for d in ds]
        params = getattr(getattr(item, "callspec", None), "params", {})
        marks = tier_marks(item.fixturenames, [f for f in functions if f is not None])
        marks |= {m.name for m in item.iter_markers() if m.name in STARTS}  # written where the reading misses
        if params.get("store_url") in ("s3", "seaweedfs"):
            marks.add("server")
        for mark in sorted(marks):
            item.add_marker(mark)
        # a CUDA test is never the edit tier: it skips on CPU, and on a GPU triton compiles its kernels
        # in subprocesses (the fast-tier guard would refuse them)
        if not marks and not item.get_closest_marker("slow") and not item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.fast)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Fail a fast-tier test that starts Ray, a uvicorn server or a subprocess, in its body or in any fixture
    it sets up (module and session ones included): it belongs in another tier. With BULKGEN_TEST_CPU set, each
    test's wall and machine CPU seconds are written there (tests/support/cpu_account.py)."""
    from contextlib import ExitStack

    from tests.support import cpu_account

    with ExitStack() as stack:
        if os.environ.get(cpu_account.ENV):
            stack.enter_context(cpu_account.accounted(item.nodeid, os.environ[cpu_account.ENV]))
        if item.get_closest_marker("fast"):
            from tests.support.tiers import fast_tier_guard

            stack.enter_context(fast_tier_guard(item.nodeid))
        yield
