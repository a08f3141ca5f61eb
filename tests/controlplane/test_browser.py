"""Real headless Chromium (Debian package) via Playwright, against daphne, a real Celery worker, fake workers:
log in, launch an attach on two workers, watch it finish, see the audit entries and a chart update pushed
over the websocket."""

import httpx
import pytest
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory, StorageProfileFactory, UserFactory
from django.contrib.auth.hashers import make_password

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def test_operator_attaches_two_workers_and_sees_live_chart(
    asgi_server, celery_worker_process, fake_worker, personas, monkeypatch
):
    from playwright.sync_api import expect, sync_playwright

    monkeypatch.setenv(
        "DJANGO_ALLOW_ASYNC_UNSAFE", "true"
    )  # Playwright's sync API keeps a loop in this thread
    fakes = [fake_worker(), fake_worker()]
    host = HostFactory(name=AGENT_HOST)  # the agent persona's token pushes metrics for this host's workers
    workers = [
        EngineWorkerFactory(name=f"gpu-{i}", url=f.url, admin_key=f.admin_key, host=host)
        for i, f in enumerate(fakes)
    ]
    StorageProfileFactory(
        name="mooncake-prod", backend="mooncake", extra_config={"master": "127.0.0.1:50051"}
    )
    alice = UserFactory(username="alice", role="operator")
    alice.password = make_password("pw-for-tests-1", hasher="pbkdf2_sha256")  # the daphne process's hasher
    alice.save()
    agent_token = personas["agent"][1]

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        page = browser.new_page()
        page.set_default_timeout(20000)
        page.goto(asgi_server + "/login/")
        page.get_by_label("Username").fill("alice")
        page.get_by_label("Password").fill("pw-for-tests-1")
        page.get_by_role("button", name="Log in").click()
        expect(page.get_by_test_id("role")).to_have_text("operator")
        expect(page.locator("body[data-ws-ready='1']")).to_have_count(1)

        page.keyboard.press("n")
        expect(page).to_have_url(asgi_server + "/operations/new/")
        for worker in workers:
            page.get_by_label(f"target {worker.name}").check()
        page.get_by_role("button", name="Preview targets").click()
        expect(page.locator("#targets .idle", has_text="idle")).to_have_count(2)
        page.get_by_label("Reason").fill("enable L3 on gpu-0/1")
        page.get_by_role("button", name="Launch").click()
        expect(page.get_by_test_id("op-state")).to_have_text("succeeded")
        expect(page.locator("#op-targets .s-succeeded")).to_have_count(2)
        assert [f.backend for f in fakes] == ["mooncake", "mooncake"]

        page.get_by_role("link", name="Audit records").click()
        rows = page.locator("#audit tbody tr", has_text="inventory.engineworker")
        expect(rows).to_have_count(2)
        expect(rows.first).to_contain_text("alice")
        expect(rows.first.locator(".diff")).to_contain_text('"mooncake"')

        page.goto(f"{asgi_server}/workers/{workers[0].pk}/")
        expect(page.locator("body[data-ws-ready='1']")).to_have_count(1)
        response = httpx.post(
            asgi_server + "/api/v1/agent/metrics/",
            json={"worker": workers[0].pk, "text": fakes[0].metrics_text()},
            headers={"Authorization": f"Bearer {agent_token}"},
        )
        assert response.status_code == 202
        expect(page.get_by_test_id("samples")).to_have_text("1")
        expect(page.locator("#chart-pool")).to_have_attribute("data-points", "1")
        browser.close()
