"""The router page in real headless Chromium (Playwright) at 1280 px against daphne: the breaker as the router
runs it. The demo's router runs with --disable-circuit-breaker, and its metrics still report every breaker
closed; the page says the breaker is off, not "all closed"."""

import os

import pytest
from cp_factories import EngineWorkerFactory, RouterFactory

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at


def test_a_router_without_its_breaker_shows_it_off(asgi_server, console_page, fake_router):
    from playwright.sync_api import expect

    router = RouterFactory(name="demo-router", url=fake_router.url, circuit_breaker=False,
                           metrics_url=f"{fake_router.url}/metrics")  # fmt: skip
    EngineWorkerFactory(name="w0", router=router)
    page, errors = console_page("gates", "viewer")
    page.goto(f"{asgi_server}/routers/{router.pk}/")
    breakers = page.get_by_test_id("breakers")
    expect(breakers).to_contain_text("off")
    expect(breakers).to_contain_text("runs without a circuit breaker")
    expect(breakers).not_to_contain_text("closed")
    expect(page.locator("#router-workers tbody tr td").nth(5)).to_have_text("off")
    expect(page.locator("#router-workers tbody tr td").nth(6)).to_have_text("–")  # no count is read
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "router-breaker-off.png"), full_page=True)
    assert errors == []
