"""Fixtures of the service tests that run images: the tiny vision-language model (lab/tiny_vision.py's LLaVA)
served beside the session's text models."""

from __future__ import annotations

import pytest

from tests.support.images import VLM


@pytest.fixture
def vlm_client(service, client, vlm_path, monkeypatch):
    """The session's client, its service serving the tiny VLM as `tiny-vlm` for this test."""
    monkeypatch.setitem(service.svc.settings.models, VLM, str(vlm_path))
    return client
