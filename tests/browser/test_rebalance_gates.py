"""What the console claims about its gates, in real headless Chromium (Playwright) at 1280 px against daphne:
the rebalance page's header names the SLO the soak gate checks, not the planner's defaults."""

import os

import pytest
from cp_factories import EngineWorkerFactory, RouterFactory

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at


def _shot(page, name: str) -> None:
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, f"{name}.png"), full_page=True)


def test_rebalance_header_says_no_slo_when_the_router_sets_none(asgi_server, console_page):
    from playwright.sync_api import expect

    router = RouterFactory(name="pd-noslo", mode="pd")
    for name, role in (("p1", "prefill"), ("d1", "decode")):
        EngineWorkerFactory(name=name, router=router, role=role)
    page, errors = console_page("gates", "viewer")
    page.goto(f"{asgi_server}/routers/{router.pk}/rebalance/")
    expect(page.get_by_test_id("slo")).to_have_text("Soak gate: no SLO set: checked health and errors only")
    # the charts' dashed line is the planner's default, which no gate checks: named so, not "SLO"
    expect(page.locator("#chart-ttft")).to_contain_text("planner default")
    expect(page.locator("#chart-ttft")).not_to_contain_text("SLO")
    _shot(page, "rebalance-no-slo")
    assert errors == []
