"""The API reference (Swagger UI at /api/docs/) in real headless Chromium at 1280 px against daphne: every
request it makes goes to the control plane itself (no CDN fonts, logos or validator badges), and it renders
the schema. ReDoc, which fetched Google fonts and a cdn.redoc.ly logo, is not served."""

import os
from urllib.parse import urlsplit

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at


def test_the_api_reference_loads_nothing_from_outside(asgi_server, console_page):
    from playwright.sync_api import expect

    own = urlsplit(asgi_server).netloc
    page, errors = console_page("gates", "viewer")
    outside: list[str] = []
    page.on("request", lambda r: urlsplit(r.url).scheme in ("http", "https")
            and urlsplit(r.url).netloc != own and outside.append(r.url))  # fmt: skip
    assert page.goto(asgi_server + "/api/redoc/").status == 404
    page.goto(asgi_server + "/api/docs/")
    expect(page.locator(".swagger-ui .info").first).to_contain_text("KVFleet control plane API")
    page.wait_for_load_state("networkidle")
    assert outside == []
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "api-docs.png"))
