"""Real headless Chromium (Debian package) via Playwright, against daphne, a real Celery worker, fake workers
and a fake sglang-router (real HTTP servers): an operator launches an attach behind a confirmation dialog,
watches it finish, reads the audit log (fits a 1280 px viewport), sees worker charts fill from websocket
pushes without a reload; at 1280 px no page's table header or heading wraps; axe-core (vendored) finds no
serious accessibility violation on any page."""

import os
import re
import time

import httpx
import pytest
from console_testlib import serious_violations
from cp_factories import (
    AGENT_HOST,
    EngineWorkerFactory,
    HostFactory,
    RouterFactory,
    StorageProfileFactory,
)

ATTACH_DIFF = re.compile(r"storage_backend: none\s*→\s*mooncake")  # from none, not only "mooncake"
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: pages are saved there to be looked at
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def wrapped_headers(page) -> list[str]:
    """Table headers, page headings, buttons in table cells and addresses (``code.addr``) that take more
    than one line or stick out of their cell, as 'tag: text' (what an operator sees as a wrapped or clipped
    header)."""
    return page.evaluate(
        """() => [...document.querySelectorAll('th, h1, td button, code.addr')].filter(el => {
          const hidden = el.querySelector('.sr-only');  // a header only screen readers read
          if (!el.getClientRects().length || (hidden && hidden.textContent === el.textContent)) return false;
          const range = document.createRange();
          range.selectNodeContents(el);
          const rects = [...range.getClientRects()].filter(r => r.width > 0);
          const bottoms = rects.map(r => r.bottom).sort((a, b) => a - b);
          const lines = bottoms.filter((b, i) => i === 0 || b - bottoms[i - 1] > 8).length;
          const box = el.tagName === 'BUTTON' ? el.getBoundingClientRect() : rects[rects.length - 1];
          const cell = el.tagName === 'BUTTON' ? el.closest('td') : el;
          return lines > 1 || (box && box.right > cell.getBoundingClientRect().right + 0.5);
        }).map(el => el.tagName.toLowerCase() + ': ' + el.textContent.trim())"""
    )


def operation_count(base: str, token: str) -> int:
    response = httpx.get(base + "/api/v1/operations/", headers={"Authorization": f"Bearer {token}"})
    return response.json()["count"]


def test_operator_console_end_to_end(  # noqa: PLR0915
    tsdb,
    asgi_server,
    console_page,
    celery_worker_process,
    fake_worker,
    fake_router,
    personas,
    monkeypatch,
    fleet_publisher,
):
    from playwright.sync_api import expect

    monkeypatch.setenv(
        "DJANGO_ALLOW_ASYNC_UNSAFE", "true"
    )  # Playwright's sync API keeps a loop in this thread
    fakes = [fake_worker(), fake_worker()]
    host = HostFactory(name=AGENT_HOST, cpu_count=16, memory_bytes=64 * 2**30)  # the agent token's host
    router = RouterFactory(name="edge", url=fake_router.url)
    workers = [
        EngineWorkerFactory(
            name=f"gpu-{i}", url=f.url, admin_key=f.admin_key, host=host, router=router, model_name="smollm2"
        )
        for i, f in enumerate(fakes)
    ]
    for f in fakes:
        fake_router.add(f.url)
    profile = StorageProfileFactory(
        name="mooncake-prod", backend="mooncake", extra_config={"master_server_address": "127.0.0.1:50051"}
    )
    admin_token = personas["admin"][1]

    page, errors = console_page("alice", "operator")
    page.set_default_timeout(20000)
    expect(page.get_by_test_id("role")).to_have_text("operator")
    expect(page.locator("body[data-ws-ready='1']")).to_have_count(1)
    expect(page.locator("#pools [data-pool=regular]")).to_contain_text("0 of 2 workers reporting")
    expect(page.locator("#hosts tbody tr").first).to_contain_text("64 GiB")
    assert serious_violations(page) == []
    assert wrapped_headers(page) == []

    page.goto(asgi_server + "/operations/")  # none yet: the page says so and where to start one
    expect(page.get_by_test_id("no-operations")).to_have_text("No operations yet. Launch one (key n).")

    # Launch form: only the chosen kind's fields; nothing is sent until the dialog is confirmed.
    page.keyboard.press("n")
    expect(page).to_have_url(asgi_server + "/operations/new/")
    # each worker's "Idle now?" is polled on load (the same poll the review makes), not left as a dash
    for i in range(len(workers)):
        expect(page.locator("#targets tbody tr").nth(i).locator(".idle")).to_have_text("idle")
    expect(page.get_by_label("Storage profile")).to_be_visible()
    page.get_by_label("Kind").select_option("detach")
    expect(page.get_by_label("Storage profile")).to_be_hidden()
    page.get_by_label("Kind").select_option("attach")
    for worker in workers:
        page.get_by_label(f"target {worker.name}").check()
    page.get_by_label("Reason (kept in the audit log and on the operation)").fill("enable L3 on gpu-0/1")
    assert serious_violations(page) == []
    assert wrapped_headers(page) == []
    page.get_by_role("button", name="Review and launch").click()
    dialog = page.locator("#confirm")
    expect(dialog).to_be_visible()
    expect(dialog.locator("#confirm-rows tr")).to_have_count(2)
    expect(dialog.locator("#confirm-rows tr").first).to_contain_text("none [idle]")
    expect(dialog.locator("#confirm-rows tr").first).to_contain_text("mooncake (mooncake-prod)")
    assert operation_count(asgi_server, admin_token) == 0  # the open dialog blocks the launch
    dialog.get_by_role("button", name="Cancel").click()
    expect(dialog).to_be_hidden()
    assert operation_count(asgi_server, admin_token) == 0
    page.get_by_role("button", name="Review and launch").click()
    dialog.get_by_role("button", name="Launch").click()

    # Operation page: reason kept, times and durations, per-worker before -> after.
    expect(page.get_by_test_id("op-state")).to_have_text("succeeded")
    expect(page.locator("#op-targets .s-succeeded")).to_have_count(2)
    expect(page.get_by_test_id("op-reason")).to_have_text("enable L3 on gpu-0/1")
    expect(page.get_by_test_id("op-duration")).not_to_contain_text("so far")
    # an attach: the old backend was there and null, so the diff says from what (not only "mooncake")
    op_diff = page.locator("#op-targets tbody tr").first.locator(".diff")
    expect(op_diff).to_contain_text(ATTACH_DIFF)
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "operation-attach.png"), full_page=True)
    expect(page.locator("#cancel")).to_be_hidden()  # finished: nothing left to cancel
    expect(page.get_by_test_id("op-outcome")).to_have_text("changed: gpu-0, gpu-1")
    op_api = httpx.get(
        asgi_server + "/api/v1/operations/", headers={"Authorization": f"Bearer {admin_token}"}
    ).json()["results"][0]
    polls = {t["worker_name"]: str(t["polls"]) for t in op_api["targets"]}
    for name, count in polls.items():
        row = page.locator("#op-targets tbody tr", has_text=name)
        expect(row.locator("td").nth(3)).to_have_text(count)
    assert [f.backend for f in fakes] == ["mooncake", "mooncake"]
    assert serious_violations(page) == []
    assert wrapped_headers(page) == []

    page.get_by_role("link", name="Audit records").click()
    rows = page.locator("#audit tbody tr", has_text="worker gpu-")
    expect(rows).to_have_count(2)
    expect(rows.first).to_contain_text("alice")
    expect(rows.first.locator(".diff")).to_contain_text(ATTACH_DIFF)
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "audit-attach.png"), full_page=True)
    expect(page.locator("#audit tbody")).not_to_contain_text("operation operation")
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    assert serious_violations(page) == []
    assert wrapped_headers(page) == []  # incl. "Reason / message" and the revert buttons
    bottoms = "[...document.querySelectorAll('#audit-filter > *')].map(e => e.getBoundingClientRect().bottom)"
    assert len(set(page.evaluate(bottoms))) == 1  # every filter and its buttons on one line
    # both workers still run what these records recorded: a revert would change nothing, none is offered
    # (the offered case: tests/browser/test_audit_page.py)
    expect(rows.get_by_role("button", name="Revert to this")).to_have_count(0)

    # Storage, host and router pages.
    page.goto(asgi_server + "/storage/")
    expect(page.locator(f"#profile-{profile.pk} [data-testid=attached]")).to_have_text("2")
    assert serious_violations(page) == []
    assert wrapped_headers(page) == []
    page.goto(f"{asgi_server}/hosts/{host.pk}/")
    expect(page.locator("#host-workers tbody tr")).to_have_count(2)
    expect(page.get_by_test_id("host-ram")).to_have_text("64 GiB")  # the fleet page's unit
    assert serious_violations(page) == []
    assert wrapped_headers(page) == []
    page.goto(f"{asgi_server}/routers/{router.pk}/")
    expect(page.locator("#router-workers tbody tr", has_text="yes")).to_have_count(2)
    assert serious_violations(page) == []
    assert wrapped_headers(page) == []

    # Worker page: live HiCache config; charts from the TSDB, filled by websocket pushes, no reload.
    fakes[0].counters.update({"device": 100, "host": 0})
    fakes[0].prompt_tokens = 400
    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped(workers[0].name)
    page.goto(f"{asgi_server}/workers/{workers[0].pk}/")
    expect(page.locator("body[data-ws-ready='1']")).to_have_count(1)
    expect(page.locator("#hicache")).to_contain_text("hicache_write_policy")
    expect(page.get_by_test_id("storage-profile")).to_contain_text("mooncake-prod")
    page.evaluate("window.__sameDocument = true")
    fakes[0].counters.update({"device": 150, "host": 150})
    fakes[0].prompt_tokens = 800  # 400 prompt tokens since the first scrape, 50 + 150 of them from cache
    pool_legend = page.locator("#chart-pool .u-legend .u-series").nth(1)
    expect(pool_legend).to_contain_text("25 %")  # 1024 of 4096 host tokens
    hits = page.locator("#chart-hits .u-legend")
    # each tier's part of the hit rate (5 min): pushed once a second; the bound is a loaded 2-core box
    expect(hits.locator(".u-series", has_text="L1 device")).to_contain_text("12.5 %", timeout=120_000)
    expect(hits.locator(".u-series", has_text="L2 host")).to_contain_text("37.5 %")
    expect(page.locator("#hit-rate-now")).to_have_text("50 %")  # 200 of 400
    expect(page.get_by_test_id("samples")).not_to_have_text("0")
    expect(page.locator("#chart-ttft")).to_have_attribute("data-window-s", "300")
    page.get_by_label("Chart time window").select_option("3600")  # every chart redraws over 1 h
    expect(page.locator(".chart[data-window-s='3600']")).to_have_count(8)
    assert page.evaluate("window.__sameDocument") is True
    assert serious_violations(page) == []
    assert wrapped_headers(page) == []

    page.goto(asgi_server + "/operations/")
    expect(page.locator("#operations tbody tr")).not_to_have_count(0)
    expect(page.get_by_test_id("no-operations")).to_be_hidden()

    # A running operation's page follows the pushes: both workers busy, then gpu-0 frees up; its row
    # shows the API's final polls and before -> after without a reload; Cancel shows only while running.
    for f in fakes:
        f.busy_polls = -1
    auth = {"Authorization": f"Bearer {admin_token}"}
    response = httpx.post(
        asgi_server + "/api/v1/operations/",
        json={"kind": "detach", "workers": [w.pk for w in workers], "reason": "live view"},
        headers=auth,
    )
    assert response.status_code in (201, 202), response.text
    op_url = f"{asgi_server}/api/v1/operations/{response.json()['id']}/"
    page.goto(op_url.replace("/api/v1", ""))
    expect(page.locator("body[data-ws-ready='1'][data-loaded='1']")).to_have_count(1)
    expect(page.get_by_test_id("op-state")).to_have_text("running")
    expect(page.locator("#cancel")).to_be_visible()
    rows = [page.locator("#op-targets tbody tr", has_text=w.name) for w in workers]
    shown = [row.locator("td").nth(3).inner_text() for row in rows]

    def polls(name):
        targets = httpx.get(op_url, headers=auth).json()["targets"]
        return next(t["polls"] for t in targets if t["worker_name"] == name)

    deadline = time.monotonic() + 20
    while polls("gpu-0") <= int(shown[0]):  # polled until the page's first read is out of date
        assert time.monotonic() < deadline, "gpu-0 is not polled for idle"
    fakes[0].busy_polls = 0
    expect(rows[0].locator(".badge")).to_have_text("succeeded")
    expect(rows[0].locator(".diff")).to_contain_text("mooncake")
    expect(rows[0].locator(".diff")).not_to_contain_text("not changed yet")
    expect(rows[0].locator("td").nth(3)).to_have_text(str(polls("gpu-0")))
    expect(rows[1].locator("td").nth(3)).not_to_have_text(shown[1])  # idle polls move without a push
    page.locator("#cancel").click()
    dialog.get_by_role("button", name="Cancel operation").click()
    expect(page.get_by_test_id("op-state")).to_have_text("cancelled")
    expect(page.locator("#cancel")).to_be_hidden()
    assert errors == []


def test_operation_page_catches_up_without_a_push(asgi_server, console_page):
    """An operation that ends while no push reaches the page (sent before the page joined its group, or lost
    while reconnecting) still shows its final state: a running operation's page re-reads it on each join and
    every few seconds."""
    from django.utils import timezone
    from playwright.sync_api import expect

    from controlplane.operations.models import Operation, OperationTarget

    worker = EngineWorkerFactory(name="gpu-quiet")
    op = Operation.objects.create(kind="detach", idle_timeout_s=60, reason="quiet")
    OperationTarget.objects.create(operation=op, worker=worker)
    page, errors = console_page("bob", "viewer", "pw-for-tests-2")
    page.goto(f"{asgi_server}/operations/{op.pk}/")
    expect(page.locator("body[data-ws-ready='1'][data-loaded='1']")).to_have_count(1)
    expect(page.get_by_test_id("op-state")).to_have_text("running")
    op.targets.update(state="succeeded", finished_at=timezone.now())  # in the database only: no push
    Operation.objects.filter(pk=op.pk).update(state="succeeded", finished_at=timezone.now())
    expect(page.get_by_test_id("op-state")).to_have_text("succeeded", timeout=15000)
    expect(page.locator("#op-targets tbody tr").first.locator(".badge")).to_have_text("succeeded")
    assert errors == []
