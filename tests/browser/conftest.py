"""Browser tests run against the control plane's fixtures (daphne, personas with real tokens, fake workers
and routers, a real Celery worker): the same conftest, loaded once. ``import *`` leaves out underscored
names, so the autouse fixtures (fresh telemetry keys per test, Playwright's longer expect timeout) are
imported by name. ``console_page``: what nearly every browser test starts with."""

import pytest
from console_testlib import CHROMIUM, CHROMIUM_ARGS, PASSWORD, console_user, log_in

from tests.controlplane.conftest import *  # noqa: F403
from tests.controlplane.conftest import _browser_expect_timeout, _fresh_telemetry_keys  # noqa: F401


@pytest.fixture
def console_page(asgi_server, monkeypatch):
    """console_page(username, role=None, password=PASSWORD, height=800) -> (page, errors): a 1280 px page
    of headless Chromium logged in to the console (daphne, ``asgi_server``) as `username`, a new user with
    `role` (None: one the test made already), and the list its uncaught page errors go to. Chromium starts
    at the first call (each later call opens another page in it) and closes after the test."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API keeps a loop running
    state = {}

    def open_page(username: str, role: str | None = None, password: str = PASSWORD, *, height: int = 800):
        if not state:
            from playwright.sync_api import sync_playwright

            state["pw"] = sync_playwright().start()
            state["browser"] = state["pw"].chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        if role is not None:
            console_user(username, role, password)
        return log_in(state["browser"], asgi_server, username, password, height=height)

    yield open_page
    if state:
        state["browser"].close()
        state["pw"].stop()
