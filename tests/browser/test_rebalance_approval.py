"""A per-step rebalance approved from its page, in real headless Chromium (Playwright) at 1280 px against
daphne: the confirmation asks for a reason, and the audit record of the approval keeps what was typed (it was
a fixed "from the console")."""

import os
from pathlib import Path

import pytest
from console_testlib import console_user
from cp_factories import EngineWorkerFactory, RouterFactory

from controlplane.audit.models import AuditEvent
from controlplane.rebalance.models import Rebalance, RebalanceStep

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at
SHOTS_DIR = Path(__file__).resolve().parents[2] / "var" / "screenshots"


def test_an_approval_keeps_the_reason_the_operator_typed(asgi_server, console_page, fake_router):
    from playwright.sync_api import expect

    router = RouterFactory(name="pd-approve", url=fake_router.url, mode="pd")
    p1 = EngineWorkerFactory(name="p1", router=router, role="prefill")
    EngineWorkerFactory(name="d1", router=router, role="decode")
    user = console_user("gates", "operator", "pw-for-tests-1")
    rb = Rebalance.objects.create(
        router=router, before_prefill=1, before_decode=1, target_prefill=0, target_decode=2, soak_s=5,
        idle_timeout_s=60, state="awaiting_approval", approval="per_step", created_by=user,
    )  # fmt: skip
    RebalanceStep.objects.create(rebalance=rb, index=0, worker=p1, from_role="prefill", to_role="decode")
    page, errors = console_page("gates")
    page.goto(f"{asgi_server}/routers/{router.pk}/rebalance/?rebalance={rb.pk}")
    # "Started" means it began changing workers: one awaiting its first approval has not.
    expect(page.get_by_test_id("rb-started")).to_have_text("not started")
    expect(page.locator("#rb-history tbody tr").first.locator("td").nth(3)).to_have_text("not started")
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "rebalance-not-started.png"), full_page=True)
    page.get_by_role("button", name="Approve next step").click()
    dialog = page.locator("#confirm")
    dialog.get_by_label("Reason (kept in the audit log)").fill("decode queue growing since 14:00")
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "rebalance-approve-dialog.png"))
    dialog.get_by_role("button", name="Approve").click()
    expect(dialog).to_be_hidden()
    record = None
    for _ in range(50):  # the POST is in flight: poll the record it writes
        record = AuditEvent.objects.filter(action="rebalance_approve").first()
        if record:
            break
        page.wait_for_timeout(100)
    assert record is not None and record.message == "decode queue growing since 14:00"
    assert errors == []


def test_the_start_form_sends_the_idle_timeout_it_checks_as_the_launch_form_does(
    asgi_server, console_page, fake_router
):
    """The start form has the launch form's idle timeout (the API's default, 0.1 to 3600 s): out of bounds
    it opens no dialog and says why; in bounds the dialog names it and the POST carries it."""
    from playwright.sync_api import expect

    router = RouterFactory(name="pd-idle", url=fake_router.url, mode="pd")
    for name, role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode")):
        EngineWorkerFactory(name=name, router=router, role=role)
    sent = []

    def refuse(route):  # what the page sends; answered as a refusal, so no rebalance starts
        sent.append(route.request.post_data_json)
        route.fulfill(status=400, json={"error": {"code": "invalid", "message": "refused by the test"}})

    page, errors = console_page("gates", "operator")
    page.route(
        "**/api/v1/rebalances/",
        lambda route: refuse(route) if route.request.method == "POST" else route.fallback(),
    )
    page.goto(f"{asgi_server}/routers/{router.pk}/rebalance/")
    idle = page.get_by_label("Idle timeout (s)")
    expect(idle).to_have_value("120")  # REBALANCE_IDLE_TIMEOUT_S, what the API uses without one
    page.get_by_test_id("target-prefill").fill("2")
    page.get_by_test_id("target-decode").fill("1")
    dialog, banner = page.locator("#confirm"), page.locator("#page-error")
    at_field = page.locator("#idle-timeout-error")  # the message sits under the field it is about
    for bad in ("0", "3601"):
        idle.fill(bad)
        page.get_by_role("button", name="Review and start").click()
        words = "Idle timeout: enter the seconds a worker may stay busy, from 0.1 to 3600."
        expect(at_field).to_have_text(words)
        expect(idle).to_have_attribute("aria-invalid", "true")
        expect(banner).to_be_hidden()
        expect(dialog).to_be_hidden()
    page.screenshot(path=str(SHOTS_DIR / "rebalance-start-idle-error.png"), full_page=True)
    idle.fill("45")
    expect(at_field).to_be_hidden()  # editing the field clears its message
    page.screenshot(path=str(SHOTS_DIR / "rebalance-start-idle.png"), full_page=True)
    page.get_by_role("button", name="Review and start").click()
    expect(dialog).to_contain_text("its step fails after 45 s")
    page.screenshot(path=str(SHOTS_DIR / "rebalance-start-idle-dialog.png"))
    dialog.get_by_role("button", name="Start rebalance").click()
    expect(banner).to_have_text("refused by the test")
    assert [body["idle_timeout_s"] for body in sent] == [45]
    assert not Rebalance.objects.exists() and errors == []


def test_a_started_rebalance_leaves_the_form_for_the_next_one(asgi_server, console_page, fake_router):
    """Once the POST starts a rebalance, the form forgets the reason and the target the operator typed: the
    target follows the recommendation again (here the router's split, while the rebalance runs)."""
    from playwright.sync_api import expect

    router = RouterFactory(name="pd-form", url=fake_router.url, mode="pd")
    for name, role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode")):
        EngineWorkerFactory(name=name, router=router, role=role)
    started = []

    def start(route):  # the rebalance the API would create; its executor is not under test here
        rb = Rebalance.objects.create(
            router=router, before_prefill=1, before_decode=2, target_prefill=2, target_decode=1,
            soak_s=5, idle_timeout_s=120, reason=route.request.post_data_json["reason"],
        )  # fmt: skip
        started.append(rb)
        route.fulfill(status=201, json={"id": rb.pk})

    page, errors = console_page("gates", "operator")
    page.route(
        "**/api/v1/rebalances/",
        lambda route: start(route) if route.request.method == "POST" else route.fallback(),
    )
    page.goto(f"{asgi_server}/routers/{router.pk}/rebalance/")
    prefill, decode = page.get_by_test_id("target-prefill"), page.get_by_test_id("target-decode")
    expect(prefill).to_have_value("1")
    prefill.fill("2")
    decode.fill("1")
    reason = page.get_by_role("textbox", name="Reason")
    reason.fill("prefill misses its TTFT SLO")
    page.get_by_role("button", name="Review and start").click()
    with page.expect_response(lambda r: r.url.endswith("/api/v1/rebalances/") and r.request.method == "POST"):
        page.locator("#confirm").get_by_role("button", name="Start rebalance").click()
    expect(page.get_by_test_id("rb-title")).to_have_text(f"#{started[0].pk}")
    assert started[0].reason == "prefill misses its TTFT SLO"
    expect(reason).to_have_value("")
    expect(prefill).to_have_value("1")
    expect(decode).to_have_value("2")
    expect(page.locator("#page-error")).to_be_hidden()
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "rebalance-started-form.png"), full_page=True)
    assert errors == []
