"""A real Chromium (Debian's, driven by Playwright) against a real bulkgen service on 127.0.0.1.

Every request the page makes is recorded; any that would leave 127.0.0.1 is refused and fails the test,
so the dashboard is shown to work offline (no CDN, fonts or scripts from elsewhere). Screenshots of each
page go to test-artifacts/dashboard/ (gitignored).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

CHROMIUM = os.environ.get("BULKGEN_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="package")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium)")
    manager = sync_playwright()
    p = manager.__enter__()
    try:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()
    finally:
        _stop_playwright(manager)


def _stop_playwright(manager) -> None:
    """Stop Playwright's driver, killing it if it has not exited within 20 s: on a loaded CI machine
    the driver once outlived its closed pipe and the session's teardown waited until pytest-timeout."""
    proc = getattr(getattr(getattr(manager, "_client", None), "_transport", None), "_proc", None)
    watchdog = threading.Timer(20, lambda: proc and proc.returncode is None and _kill(proc.pid))
    watchdog.start()
    try:
        manager.__exit__(None, None, None)
    finally:
        watchdog.cancel()


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def root_url(service) -> str:
    return service.base_url.removesuffix("/v1")


class Requests:
    """Every URL the page asked for; anything not on 127.0.0.1 is aborted and remembered."""

    def __init__(self) -> None:
        self.urls: list[str] = []
        self.outside: list[str] = []

    def handle(self, route) -> None:
        url = route.request.url
        self.urls.append(url)
        parts = urlsplit(url)
        if parts.scheme in ("http", "https", "ws", "wss") and parts.hostname == "127.0.0.1":
            route.continue_()
        else:
            self.outside.append(url)
            route.abort()


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1280, "height": 900}, accept_downloads=True)
    seen = Requests()
    context.route("**/*", seen.handle)
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.on("dialog", lambda d: d.accept())  # the cancel button's confirm()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    # what the service's Content-Security-Policy blocked (an inline script or style the page relies on)
    page.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
    page.requests = seen
    yield page
    context.close()
    assert seen.urls, "the page made no request at all"
    assert not seen.outside, f"requests left 127.0.0.1: {seen.outside}"
    assert not errors, f"script errors on the page: {errors}"


def _serve(app):
    """Run `app` on a free port of 127.0.0.1 in a thread; yields its root URL."""
    from tests.support.service import start_uvicorn

    server, thread, port = start_uvicorn(app)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="session")
def keyed_url(service):
    """A second app over the same service and manager with one API key (create_app's `api_key`)."""
    from bulkgen.api import create_app

    yield from _serve(create_app(service.svc, service.manager, "dash-key"))


@pytest.fixture(scope="session")
def tenants_url(service):
    """An app with two tenants' keys: `own-key` (the session service's tenant) and `other-key` (team-z)."""
    from bulkgen.api import create_app
    from bulkgen.tenants import KeyRing, hash_key

    ring = KeyRing({hash_key("own-key"): service.svc.tenant, hash_key("other-key"): "team-z"})
    yield from _serve(create_app(service.svc, service.manager, keyring=ring))
