"""The audit page in real headless Chromium (Playwright) at 1280 px against daphne: each row shows its record
id (the id the revert dialog cites), and "Revert to this" is offered only where it would change a worker,
its dialog listing exactly those workers, now -> after."""

import os
import re

import pytest
from cp_factories import EngineWorkerFactory

from controlplane.audit.services import audit_record

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at


def test_revert_is_offered_only_where_it_changes_a_worker(asgi_server, console_page):
    from playwright.sync_api import expect

    attached = EngineWorkerFactory(name="attached-since", storage_backend="file")
    detached = EngineWorkerFactory(name="still-detached", storage_backend="")
    events = {
        w.name: audit_record(
            action="detach", obj=w, extra={"restore": {"kind": "detach", "worker_ids": [w.pk]}}
        )
        for w in (attached, detached)
    }
    page, errors = console_page("gates", "operator")
    page.goto(f"{asgi_server}/audit/?action=detach")
    changed = page.locator("#audit tbody tr", has_text="attached-since")
    same = page.locator("#audit tbody tr", has_text="still-detached")
    expect(changed.get_by_test_id("record-id")).to_contain_text(f"record #{events['attached-since'].pk}")
    expect(same.get_by_role("button", name="Revert to this")).to_have_count(0)
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "audit-revert.png"), full_page=True)
    changed.get_by_role("button", name="Revert to this").click()
    dialog = page.locator("#confirm")
    expect(dialog).to_contain_text(f"record #{events['attached-since'].pk}")
    expect(dialog.locator("#confirm-rows tr")).to_have_count(1)
    expect(dialog.locator("#confirm-rows tr")).to_have_text("attached-sincefilenone")
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "audit-revert-dialog.png"))
    assert errors == []


def test_a_multi_worker_change_is_reverted_together_and_a_role_switch_links_its_rebalance(
    asgi_server, console_page
):
    from cp_factories import RouterFactory
    from playwright.sync_api import expect

    from controlplane.rebalance.models import Rebalance

    workers = [EngineWorkerFactory(name=n, storage_backend="file") for n in ("w-one", "w-two")]
    first = [
        audit_record(
            action="detach",
            obj=w,
            operation_id=7,
            extra={"restore": {"kind": "detach", "worker_ids": [w.pk]}},
        )
        for w in workers
    ][0]
    router = RouterFactory(name="pd-r", mode="pd")
    rb = Rebalance.objects.create(
        router=router, before_prefill=2, before_decode=1, target_prefill=1, target_decode=2, soak_s=1,
        idle_timeout_s=1, state="succeeded",
    )  # fmt: skip
    audit_record(
        action="role_switch", obj=workers[0], before={"role": "prefill"}, after={"role": "decode"},
        extra={"rebalance_id": rb.pk, "router_id": router.pk, "step_index": 0},
    )  # fmt: skip
    page, errors = console_page("gates", "operator")
    page.goto(f"{asgi_server}/audit/")
    switch = page.locator("#audit tbody tr", has_text="role switch")
    link = switch.get_by_test_id("rebalance-link")
    expect(link).to_have_text(f"rebalance #{rb.pk}, step 1")
    expect(link).to_have_attribute("href", f"/routers/{router.pk}/rebalance/?rebalance={rb.pk}")
    expect(switch.locator(".diff")).to_contain_text("role")
    row = page.locator(f"#audit tbody tr[data-event='{first.pk}']")
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "audit-together.png"), full_page=True)
    row.get_by_test_id("revert-together").click()
    dialog = page.locator("#confirm")
    expect(dialog).to_contain_text("operation #7")
    expect(dialog.locator("#confirm-rows tr")).to_have_count(2)
    with page.expect_navigation(url="**/operations/*/"):
        dialog.get_by_role("button", name="Launch revert").click()
    expect(page.locator("#op-targets tbody tr")).to_have_count(2)
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "audit-together-operation.png"), full_page=True)
    assert errors == []


def test_two_long_values_that_share_their_start_show_where_they_differ(asgi_server, console_page):
    """A host re-registering with one GPU changed: both values are 300 characters that agree for their first
    200, so a summary of each value's start read the same on both sides of the change."""
    from playwright.sync_api import expect

    common = "gpu-" + "x" * 196
    before, after = common + "A" * 100, common + "B" * 100
    audit_record(action="register", object_type="inventory.host", object_id="9", object_repr="long-host",
                 before={"gpus": before}, after={"gpus": after})  # fmt: skip
    page, errors = console_page("gates", "operator")
    page.goto(f"{asgi_server}/audit/?action=register")
    row = page.locator("#audit tbody tr", has_text="long-host")
    expect(row.locator("del summary")).to_have_text("…" + "x" * 10 + "A" * 30 + "… (300 chars)")
    expect(row.locator("ins summary")).to_have_text("…" + "x" * 10 + "B" * 30 + "… (300 chars)")
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    assert errors == []


def test_a_first_attach_is_undone_with_a_reason_and_drain(asgi_server, console_page):
    """A fleet's first change, an attach: "Revert to this" has nothing to offer (the worker is in the state
    the record left), "Undo" puts it back to the state the record found. Its dialog shows now -> after, asks
    for a reason (it cannot be confirmed without one) and offers the drain, ticked; confirming launches the
    operation and opens its page."""
    from playwright.sync_api import expect

    from controlplane.operations.models import Operation

    worker = EngineWorkerFactory(name="first-attach", storage_backend="file")
    event = audit_record(action="attach", obj=worker, before={"hicache_storage_backend": None},
                         after={"hicache_storage_backend": "file"})  # fmt: skip
    page, errors = console_page("undoer", "operator")
    page.goto(f"{asgi_server}/audit/?action=attach")
    row = page.locator("#audit tbody tr", has_text="first-attach")
    expect(row.get_by_role("button", name="Revert to this")).to_have_count(0)
    row.get_by_role("button", name="Undo").click()
    dialog = page.locator("#confirm")
    expect(dialog).to_contain_text(f"Undo record #{event.pk}?")
    expect(dialog.locator("#confirm-rows tr")).to_have_text("first-attachfilenone")
    expect(dialog.locator("#confirm-drain")).to_be_checked()
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "audit-undo-dialog.png"))
    dialog.get_by_role("button", name="Launch undo").click()  # no reason typed: the dialog stays
    expect(dialog).to_be_visible()
    assert Operation.objects.count() == 0
    dialog.locator("#confirm-reason").fill("the L3 made TTFT worse")
    dialog.get_by_role("button", name="Launch undo").click()
    expect(page).to_have_url(re.compile(r"/operations/\d+/$"))
    op = Operation.objects.get()
    assert (op.kind, op.drain, op.reason) == ("detach", True, f"undo of audit record {event.pk}: the L3 made "
                                              "TTFT worse")  # fmt: skip
    assert errors == []
