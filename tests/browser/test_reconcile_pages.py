"""The reconciler on the console, in real headless Chromium (Playwright) at 1280 px against daphne: after a
pass that repaired a router's worker list and found a URL it cannot account for, the router page lists the
repair and the alert, and the fleet page shows the alert with its router."""

import os

import pytest
from cp_factories import EngineWorkerFactory, HostFactory, RouterFactory
from django.utils import timezone

from controlplane.rebalance.services.reconcile import reconcile_all
from controlplane.workerclient import RouterClient

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at


def test_repairs_and_alerts_show_on_the_router_and_fleet_pages(
    asgi_server, console_page, fake_worker, fake_router
):
    from playwright.sync_api import expect

    router = RouterFactory(name="pd-main", url=fake_router.url, mode="pd")
    host = HostFactory(name="gpu-host")
    decode = fake_worker(pd_role="decode")
    EngineWorkerFactory(
        name="d-moved", url=decode.url, admin_key=decode.admin_key, router=router, host=host, role="decode",
        last_seen=timezone.now(), assigned_role="decode",
    )  # fmt: skip
    client = RouterClient(router.url)
    client.add_worker(decode.url, worker_type="prefill", bootstrap_port=8998)  # a restart's old argv
    client.add_worker("http://stranger:1", worker_type="decode")
    repairs = reconcile_all()
    assert [r["action"] for r in repairs] == ["reconcile_router"]
    page, errors = console_page("vera", "viewer")
    page.goto(f"{asgi_server}/routers/{router.pk}/")
    expect(page.get_by_test_id("reconcile-repairs")).to_contain_text("listed it as prefill")
    expect(page.get_by_test_id("fleet-alerts")).to_contain_text("lists http://stranger:1")
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "router-reconcile.png"), full_page=True)
    page.goto(f"{asgi_server}/")
    alerts = page.get_by_test_id("fleet-alerts")
    expect(alerts.get_by_role("link", name="pd-main")).to_have_attribute("href", f"/routers/{router.pk}/")
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "fleet-reconcile.png"), full_page=True)
    assert errors == []


def _open_synced(page, url: str):
    """Open `url` and wait until its alert card has read the open alerts after joining the websocket, so
    whatever the card shows later came over the socket. Marks the window to tell a reload apart."""
    from playwright.sync_api import expect

    page.goto(url)
    expect(page.locator("#fleet-alerts[data-synced='1']")).to_be_attached()
    page.evaluate("window.kvfleetNotReloaded = true")


def test_alerts_open_and_resolve_live_on_the_fleet_and_router_pages(
    asgi_server, console_page, fake_worker, fake_router
):
    """Both pages open with no alert; a reconcile pass that finds a stranger in pd-main's list and pd-gone not
    answering shows both on the fleet page and only pd-main's on its router page, without reload; the pass
    after the stranger left removes it from both pages, and the router page's card is hidden again."""
    from playwright.sync_api import expect

    router = RouterFactory(name="pd-main", url=fake_router.url, mode="pd")
    RouterFactory(name="pd-gone", url="http://127.0.0.1:9", mode="pd")  # nothing listens: router_unreachable
    decode = fake_worker(pd_role="decode")
    EngineWorkerFactory(
        name="d-0", url=decode.url, admin_key=decode.admin_key, router=router,
        host=HostFactory(name="gpu-host"), role="decode", last_seen=timezone.now(),
    )  # fmt: skip
    client = RouterClient(router.url)
    client.add_worker(decode.url, worker_type="decode")
    fleet, errors = console_page("vera", "viewer")
    routerpage, router_errors = console_page("vera")
    _open_synced(fleet, f"{asgi_server}/")
    _open_synced(routerpage, f"{asgi_server}/routers/{router.pk}/")
    for page in (fleet, routerpage):
        expect(page.get_by_test_id("fleet-alerts")).to_be_hidden()

    client.add_worker("http://stranger:1", worker_type="decode")
    assert reconcile_all() == []
    fleet_alerts = fleet.get_by_test_id("fleet-alerts")
    router_alerts = routerpage.get_by_test_id("fleet-alerts")
    expect(fleet_alerts.locator("li")).to_have_count(2)
    expect(fleet_alerts).to_contain_text("lists http://stranger:1")
    expect(fleet_alerts.get_by_role("link", name="pd-gone")).to_be_visible()
    main_link = fleet_alerts.get_by_role("link", name="pd-main")
    expect(main_link).to_have_attribute("href", f"/routers/{router.pk}/")
    expect(router_alerts.locator("li")).to_have_count(1)
    expect(router_alerts).to_contain_text("lists http://stranger:1")
    assert fleet.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        fleet.screenshot(path=os.path.join(SHOTS, "fleet-alert-live.png"), full_page=True)

    client.remove_worker("http://stranger:1")
    assert reconcile_all() == []
    expect(router_alerts).to_be_hidden()
    expect(fleet_alerts.locator("li")).to_have_count(1)
    expect(fleet_alerts).not_to_contain_text("stranger")
    expect(fleet_alerts).to_contain_text("pd-gone")
    for page in (fleet, routerpage):
        assert page.evaluate("window.kvfleetNotReloaded") is True
    assert errors == router_errors == []
