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
    # the recommendation still judges the pools against an SLO: the header names it, and whose it is
    expect(page.get_by_test_id("planner-slo")).to_have_text(
        "Recommendation judged against TTFT p90 500 ms, ITL p90 50 ms"
        " (planner defaults: the router sets none)"
    )
    # the charts' dashed line is the planner's default, which no gate checks: named so, not "SLO"
    expect(page.locator("#chart-ttft")).to_contain_text("planner default")
    expect(page.locator("#chart-ttft")).not_to_contain_text("SLO")
    _shot(page, "rebalance-no-slo")
    assert errors == []


def test_rebalance_header_says_whose_slo_the_recommendation_uses(asgi_server, console_page):
    """A router that sets only a TTFT SLO: the recommendation uses it and the planner's default ITL, each
    named so; the soak gate checks the router's TTFT only."""
    from playwright.sync_api import expect

    router = RouterFactory(name="pd-ttft", mode="pd", slo_ttft_p90_s=0.3)
    for name, role in (("p1", "prefill"), ("d1", "decode")):
        EngineWorkerFactory(name=name, router=router, role=role)
    page, errors = console_page("gates", "viewer")
    page.goto(f"{asgi_server}/routers/{router.pk}/rebalance/")
    expect(page.get_by_test_id("planner-slo")).to_have_text(
        "Recommendation judged against TTFT p90 300 ms (the router's), ITL p90 50 ms (planner default)"
    )
    expect(page.get_by_test_id("slo")).to_have_text("Soak gate: TTFT p90 ≤ 0.3 s")
    _shot(page, "rebalance-router-ttft-slo")
    assert errors == []
