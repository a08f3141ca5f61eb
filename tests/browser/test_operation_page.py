"""The operation page in real headless Chromium (Playwright) at 1280 px against daphne: "Started" is the
launch time, and the page shows one API snapshot: a state push is a cue to re-read, never a state shown beside
an older finish time and older targets."""

import os
import time
from datetime import UTC

import pytest
from cp_factories import EngineWorkerFactory

from controlplane.core.broadcast import emit
from controlplane.core.events import operation_group
from controlplane.operations.models import ACTIVE_STATES
from controlplane.operations.services import operation_create, target_step

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")


def _run_to_the_end(op) -> None:
    target = op.targets.get()
    deadline = time.monotonic() + 20
    while target.state in ACTIVE_STATES:  # what the Celery task does, step by step
        assert time.monotonic() < deadline, target.explanation
        delay = target_step(target_id=target.pk)
        target.refresh_from_db()
        if delay and target.state in ACTIVE_STATES:
            time.sleep(delay)


def test_the_operation_page_shows_one_snapshot_and_started_is_the_launch_time(
    asgi_server, console_page, fake_worker
):
    from playwright.sync_api import expect

    fake = fake_worker()
    worker = EngineWorkerFactory(name="w-snap", url=fake.url, admin_key=fake.admin_key)
    op = operation_create(  # not dispatched: the test runs the steps itself (a session Celery worker may run)
        kind="detach", workers=[worker], actor=None, idle_timeout_s=5, reason="snapshot", dispatch=False
    )
    page, errors = console_page("snap", "operator")
    page.goto(f"{asgi_server}/operations/{op.pk}/")
    expect(page.get_by_test_id("op-state")).to_have_text("running")
    started = page.get_by_test_id("op-started")
    launched = op.created_at.astimezone(UTC)
    expect(started).to_have_attribute(
        "datetime", launched.strftime("%Y-%m-%dT%H:%M:%S.") + f"{launched.microsecond // 1000:03d}Z"
    )

    # A push that disagrees with the database: the page re-reads and never shows the push's state.
    page.evaluate("""() => { window.seenStates = []; const el = document.getElementById("op-state");
        new MutationObserver(() => window.seenStates.push(el.textContent))
          .observe(el, {childList: true, characterData: true, subtree: true}); }""")
    url = f"{asgi_server}/api/v1/operations/{op.pk}/"
    with page.expect_response(lambda r: r.url == url):
        data = {"operation_id": op.pk, "state": "succeeded", "explanation": "", "summary": {}}
        emit(operation_group(op.pk), "operation.state_changed", data, wait=True)
    page.wait_for_load_state("networkidle")
    expect(page.get_by_test_id("op-state")).to_have_text("running")
    expect(page.locator("#op-facts time[data-f=finished_at]")).to_have_text("–")
    assert "succeeded" not in page.evaluate("window.seenStates")

    _run_to_the_end(op)  # the real pushes, after commit: final state, finish time and targets together
    expect(page.get_by_test_id("op-state")).to_have_text("succeeded")
    expect(page.locator("#op-facts time[data-f=finished_at]")).not_to_have_text("–")
    expect(page.locator("#op-targets tbody tr .badge")).to_have_text("succeeded")
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "operation-snapshot.png"), full_page=True)
    launched_at = started.get_attribute("datetime")
    page.goto(f"{asgi_server}/operations/")  # the list's "Started" is the same moment
    expect(page.locator("#operations tbody tr time").first).to_have_attribute("datetime", launched_at)
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "operations-started.png"), full_page=True)
    assert errors == []


def test_a_cancelled_target_says_it_was_not_changed_and_why(
    asgi_server, console_page, fake_worker, monkeypatch
):
    """A target cancelled while it waited for idle has a before and no after: final, so its Before → after
    cell says "not changed (cancelled)", never "not changed yet" as if it might still change."""
    from playwright.sync_api import expect

    from controlplane.operations.services import operation_cancel, transitions

    monkeypatch.setattr(transitions, "publish_steps", lambda ids: None)  # the test runs the steps itself
    fake = fake_worker(busy_polls=-1)  # busy: the target waits for idle until cancelled
    worker = EngineWorkerFactory(name="w-cancel", url=fake.url, admin_key=fake.admin_key)
    op = operation_create(
        kind="detach", workers=[worker], actor=None, idle_timeout_s=60, reason="cancel test", dispatch=False
    )
    target = op.targets.get()
    target_step(target_id=target.pk)
    target.refresh_from_db()
    assert target.state == "waiting_for_idle" and target.before is not None, target.state
    page, errors = console_page("snap", "operator")
    page.goto(f"{asgi_server}/operations/{op.pk}/")
    diff = page.locator("#op-targets tbody tr .diff")
    expect(diff).to_have_text("not changed yet")  # still waiting: it may change
    operation_cancel(op=op, actor=None, reason="cancel test")
    _run_to_the_end(op)
    expect(page.get_by_test_id("op-state")).to_have_text("cancelled")
    expect(page.locator("#op-targets tbody tr .badge")).to_have_text("cancelled")
    expect(diff).to_have_text("not changed (cancelled)")
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "operation-cancelled.png"), full_page=True)
    assert errors == []


def test_a_refused_step_shows_the_worker_s_message_once_and_the_worker_name_whole(
    asgi_server, console_page, fake_worker
):
    """The engine refuses an attach with its JSON error body: the target row says what the worker said (the
    message, not the JSON), the operation's explanation names the worker without repeating it, and a long
    hyphenated worker name stays on one line."""
    from cp_factories import StorageProfileFactory
    from playwright.sync_api import expect

    fake = fake_worker()
    fake.refuse_attach = "lmcache_url: 'lm://cache-host' is not lm://host:port (a port in 1..65535)"
    name = "prefill-worker-eu-west-1a-07"
    worker = EngineWorkerFactory(name=name, url=fake.url, admin_key=fake.admin_key)
    profile = StorageProfileFactory(name="lm", backend="lmcache", extra_config={})
    op = operation_create(
        kind="attach", workers=[worker], actor=None, storage_profile=profile, idle_timeout_s=5,
        reason="refused step", dispatch=False,
    )  # fmt: skip
    _run_to_the_end(op)
    op.refresh_from_db()
    assert op.state == "failed" and '{"error"' in op.explanation, op.explanation  # raw in the record
    page, errors = console_page("refused", "operator")
    page.goto(f"{asgi_server}/operations/{op.pk}/")
    expect(page.get_by_test_id("op-state")).to_have_text("failed")
    body = page.locator("main").inner_text()
    assert "{" not in body and '"error"' not in body, body
    assert body.count("is not lm://host:port") == 1, body
    row = page.locator("#op-targets tbody tr")
    expect(row.locator("td").nth(2)).to_contain_text(
        "worker answered 400: Failed to attach HiCache storage backend. lmcache_url: 'lm://cache-host' is not"
    )
    expect(page.locator("#op-explanation")).to_contain_text(f"{name} failed (see Targets)")
    link = row.locator("td").first.locator("a")
    expect(link).to_have_text(name)
    height = link.evaluate("el => el.getBoundingClientRect().height")
    line = link.evaluate("el => parseFloat(getComputedStyle(el).lineHeight) || 20")
    assert height < 1.5 * line, (height, line)  # one line: the name is not broken at its hyphens
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    page.screenshot(path=os.path.join(SHOTS or "/tmp", "operation-refused.png"), full_page=True)
    assert errors == []
