"""An operation whose busy worker stayed busy past the idle timeout, in real headless Chromium (Playwright) at
1280 px against daphne: the operation page says to retry with drain and offers it, and the launch form opens
with the same change, drain on and that worker picked."""

import os
import time

import pytest
from cp_factories import EngineWorkerFactory, RouterFactory

from controlplane.operations.models import ACTIVE_STATES
from controlplane.operations.services import operation_create, target_step

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at


def _failed_busy_detach(fake_worker, fake_router):
    busy = fake_worker(busy_polls=-1)
    fake_router.add(busy.url)
    router = RouterFactory(url=fake_router.url)
    worker = EngineWorkerFactory(name="busy", url=busy.url, admin_key=busy.admin_key, router=router)
    op = operation_create(kind="detach", workers=[worker], actor=None, idle_timeout_s=0.5, reason="try")
    target = op.targets.get()
    deadline = time.monotonic() + 20
    while target.state in ACTIVE_STATES:  # what the Celery task does, step by step
        assert time.monotonic() < deadline, target.explanation
        delay = target_step(target_id=target.pk)
        target.refresh_from_db()
        if delay and target.state in ACTIVE_STATES:
            time.sleep(delay)
    return op, worker


def test_a_busy_worker_past_the_idle_timeout_is_offered_a_retry_with_drain(
    asgi_server, console_page, fake_worker, fake_router
):
    from playwright.sync_api import expect

    op, worker = _failed_busy_detach(fake_worker, fake_router)
    page, errors = console_page("gates", "operator")
    page.goto(f"{asgi_server}/operations/{op.pk}/")
    expect(page.locator("#op-targets tbody tr")).to_contain_text("retry with drain on")
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "operation-retry-drain.png"), full_page=True)
    page.get_by_test_id("retry-drain").click()
    expect(page.get_by_label("drain each worker from its router while applying")).to_be_checked()
    expect(page.locator("#kind")).to_have_value("detach")
    expect(page.get_by_label("Reason (kept in the audit log and on the operation)")).to_have_value("try")
    expect(page.get_by_label("target busy")).to_be_checked()
    idle = page.locator(f'tr[data-worker="{worker.pk}"] .idle')
    expect(idle).to_have_text("busy (2 running, 1 waiting, 3 HTTP requests unanswered)")
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "launch-retry-drain.png"), full_page=True)
    _review_without_drain_warns(page)
    assert errors == []


def _review_without_drain_warns(page) -> None:
    """Review with drain off: the confirmation says a busy worker may never go idle without drain."""
    from playwright.sync_api import expect

    page.get_by_label("drain each worker from its router while applying").uncheck()
    page.get_by_label("Reason (kept in the audit log and on the operation)").fill("retry after idle timeout")
    page.locator("#review").click()
    dialog = page.locator("dialog[open]")
    expect(dialog).to_contain_text("may never be idle without drain")
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "launch-review-busy-no-drain.png"), full_page=True)
    dialog.get_by_role("button", name="Cancel").click()
    expect(page.locator("dialog[open]")).to_have_count(0)


def test_drain_defaults_on_for_workers_behind_a_router(asgi_server, console_page):
    """A worker behind a router (the demo's: its traffic keeps it busy) gets drain on by default; one without
    a router (a drain there is refused) off; the operator's own click on the box then wins."""
    from playwright.sync_api import expect

    routed = EngineWorkerFactory(name="routed", router=RouterFactory())
    EngineWorkerFactory(name="bare")
    page, errors = console_page("drainer", "operator")
    page.goto(f"{asgi_server}/operations/new/?worker={routed.pk}")
    drain = page.get_by_label("drain each worker from its router while applying")
    expect(page.get_by_label("target routed")).to_be_checked()
    expect(drain).to_be_checked()
    expect(page.get_by_test_id("drain-help")).to_contain_text("every picked worker is served by a router")
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "launch-drain-default.png"), full_page=True)
    page.get_by_label("target bare").check()
    expect(drain).not_to_be_checked()
    page.get_by_label("target bare").uncheck()
    expect(drain).to_be_checked()
    drain.uncheck()
    page.get_by_label("target bare").check()
    page.get_by_label("target bare").uncheck()
    expect(drain).not_to_be_checked()
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    assert errors == []
