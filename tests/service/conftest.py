"""Fixtures of the service tests that run images: the tiny vision-language model (lab/tiny_vision.py's LLaVA)
served beside the session's text models."""

from __future__ import annotations

import pytest

from bulkgen.lab.tiny_vision import build_tiny_vlm
from tests.support.images import VLM


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", "llava", seed=3)


@pytest.fixture
def vlm_client(service, client, vlm_path, monkeypatch):
    """The session's client, its service serving the tiny VLM as `tiny-vlm` for this test."""
    monkeypatch.setitem(service.svc.settings.models, VLM, str(vlm_path))
    return client
