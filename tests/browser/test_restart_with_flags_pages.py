"""restart_with_flags in the console, real headless Chromium at 1280 px against daphne: the worker page's
command line and its link to the launch form, the form's flags fields and its confirmation (each worker's
command line now -> the change), and the operation page's change line and per-target command lines before
and after, the flags that differ marked."""

import os

import pytest
from console_testlib import serious_violations
from cp_factories import EngineWorkerFactory, HostFactory
from django.utils import timezone

from controlplane.operations.models import Operation
from controlplane.operations.services import operation_create
from engine.agent.spec import WorkerSpec, flag_table

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")
LINE = ["--model-path=smollm2", "--port=30001", "--page-size=16", "--enable-hierarchical-cache"]


def test_the_restart_form_and_the_command_lines_before_and_after(asgi_server, console_page):
    from playwright.sync_api import expect

    spec = WorkerSpec(name="x", model="smollm2", role="mixed", host="127.0.0.1", port=1, url="", flags=[])
    worker = EngineWorkerFactory(
        name="kv-page", url="http://127.0.0.1:9/", host=HostFactory(), command_line=LINE,
        launch_flags=flag_table(spec),
    )  # fmt: skip
    page, errors = console_page("restarter", "operator", height=900)
    # the worker page shows its command line and leads to the launch form, this worker and kind chosen
    page.goto(f"{asgi_server}/workers/{worker.pk}/")
    expect(page.get_by_test_id("command-line")).to_contain_text(" ".join(LINE))
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "restart-worker.png"), full_page=True)
    page.get_by_role("link", name="restart with other flags…").click()
    expect(page.get_by_label("Kind")).to_have_value("restart_with_flags")
    expect(page.get_by_label("target kv-page")).to_be_checked()
    expect(page.get_by_label("Storage profile")).to_be_hidden()
    page.locator("#flags-set").fill("page_size=32\nmax_running_requests=8")
    page.locator("#flags-remove").fill("enable_hierarchical_cache")
    page.get_by_label("Reason (kept in the audit log and on the operation)").fill("bigger pages")
    assert serious_violations(page) == []
    page.get_by_role("button", name="Review and launch").click()
    dialog = page.locator("#confirm")
    expect(dialog).to_be_visible()
    row = dialog.locator("#confirm-rows tr").first
    expect(row).to_contain_text(" ".join(LINE))
    expect(row).to_contain_text("set page_size=32 max_running_requests=8; remove enable_hierarchical_cache")
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "restart-launch.png"), full_page=True)
    dialog.get_by_role("button", name="Cancel").click()
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "restart-form.png"), full_page=True)
    assert not Operation.objects.exists()

    # the page of such an operation once done (its steps are not run here: the state is written as they would)
    op = operation_create(
        kind="restart_with_flags", workers=[worker], actor=None, reason="bigger pages", dispatch=False,
        flags={"set": {"page_size": 32}, "remove": ["enable_hierarchical_cache"]},
    )  # fmt: skip
    after = ["--model-path=smollm2", "--port=30001", "--page-size=32"]
    op.targets.update(state="succeeded", before={"command_line": LINE}, after={"command_line": after})
    summary = {"succeeded": ["kv-page"], "changed": ["kv-page"], "restored": [], "left_changed": {}}
    op.targets.update(finished_at=timezone.now(), changed=True)
    Operation.objects.filter(pk=op.pk).update(state="succeeded", finished_at=timezone.now(), summary=summary)
    page.goto(f"{asgi_server}/operations/{op.pk}/")
    expect(page.get_by_test_id("op-state")).to_have_text("succeeded")
    expect(page.locator("#op-facts")).to_contain_text(
        "restart with flags: set page_size=32; remove enable_hierarchical_cache"
    )
    cell = page.locator("#op-targets tbody tr").first.locator(".diff")
    expect(cell.locator(".cmdline")).to_have_count(2)
    expect(cell.locator("del")).to_have_text(["--page-size=16", "--enable-hierarchical-cache"])
    expect(cell.locator("ins")).to_have_text(["--page-size=32"])
    assert serious_violations(page) == []
    overflow = page.evaluate("document.documentElement.scrollWidth > document.documentElement.clientWidth")
    assert not overflow, "the command lines widen the page past 1280 px"
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "restart-operation.png"), full_page=True)
    assert errors == []
