"""The storage page's new-profile form in real headless Chromium at 1280 px against daphne: the hint under
the extra config follows the chosen backend, a value the worker would refuse is refused at the field's
error naming the key, and a saved profile is confirmed at the top with its row marked."""

import os

import pytest

from controlplane.inventory.models import StorageProfile

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")


def test_the_form_hints_the_backends_keys_refuses_a_bad_value_and_confirms_the_save(
    asgi_server, console_page
):
    from playwright.sync_api import expect

    page, errors = console_page("stor", "operator", height=1000)
    page.goto(f"{asgi_server}/storage/")
    form = page.locator("#profile-form")
    hints = form.get_by_test_id("extra-hints")
    expect(hints.locator("[data-backend=file]")).to_be_visible()
    form.get_by_label("Backend").select_option("lmcache")
    expect(hints.locator("[data-backend=file]")).to_be_hidden()
    expect(hints.locator("[data-backend=lmcache]")).to_contain_text("lmcache_url: lm://host:port")
    textarea = form.get_by_label("Extra config (JSON object)")
    expect(textarea).to_have_attribute("aria-describedby", "hint-lmcache hicache-hint")
    form.get_by_label("Name").fill("lm-east")
    textarea.fill('{"lmcache_url": "lm://cache-host", "lmcache_timeout_s": 5}')
    form.get_by_role("button", name="Create").click()
    expect(page.locator("#profile-error")).to_contain_text(
        "lmcache_url: 'lm://cache-host' is not lm://host:port"
    )
    assert not StorageProfile.objects.exists()
    textarea.fill('{"lmcache_url": "lm://cache-host:65432", "lmcache_timeout_s": 5}')
    form.get_by_role("button", name="Create").click()
    saved = page.get_by_test_id("profile-saved")
    expect(saved).to_contain_text("Saved profile lm-east (lmcache, 2 extra-config keys")
    made = StorageProfile.objects.get()
    expect(page.locator(f"#profile-{made.pk}")).to_have_class("saved")
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    page.screenshot(path=os.path.join(SHOTS or "/tmp", "storage-saved.png"), full_page=True)
    assert errors == []
