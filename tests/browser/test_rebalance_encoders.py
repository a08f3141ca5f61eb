"""The rebalance page shows the planner's advice on a PD router's EPD encoders (real headless Chromium
against daphne): encoders busy 95 % of the time while the client's TTFT p90 (measured on the decode worker)
is over the SLO reads "add an encoder", beside the P:D recommendation, which counts no encoder."""

import os
import time

import pytest
from console_testlib import serious_violations
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory, RouterFactory
from test_rebalance_page import Exporter

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at


def _encoder_text(images: float, seconds: float) -> str:
    return "".join(
        f'# TYPE sglang:{k} counter\nsglang:{k}{{model_name="m"}} {v}\n'
        for k, v in (("encoder_images_total", images), ("encoder_encode_seconds_total", seconds))
    )


def test_busy_encoders_while_ttft_misses_its_slo_read_add_an_encoder(
    tsdb, asgi_server, console_page, personas
):
    from playwright.sync_api import expect

    host = HostFactory(name=AGENT_HOST)
    router = RouterFactory(name="epd", mode="pd", slo_ttft_p90_s=0.5, slo_itl_p90_s=0.05)
    for name, role in (("p1", "prefill"), ("d1", "decode"), ("e1", "encoder")):
        EngineWorkerFactory(name=name, url=f"http://{name}.local:1", host=host, router=router, role=role)
    scrapes = []

    def push(name, text, ts):  # the TSDB's scrape of the worker at ``ts``
        scrapes.append((name, ts, text))

    prefill, decode = Exporter(), Exporter()
    now = time.time()
    for i, ts in enumerate((now - 42, now - 22, now - 2)):
        push("p1", prefill.serve(20, 200, 0, 8, None, 0.01), ts)
        push("d1", decode.serve(20, 200, 0, 8, 2.0, 0.01), ts)  # the client's TTFT: 2 s, SLO 0.5 s
        push("e1", _encoder_text(100.0 * i, 19.0 * i), ts)  # 5 images/s, 95 % busy
    tsdb.serve(scrapes)

    page, errors = console_page("vera", "viewer")
    page.goto(f"{asgi_server}/routers/{router.pk}/rebalance/")
    box = page.get_by_test_id("rec-encoders")
    expect(box).to_be_visible()
    expect(box).to_contain_text("add encoder")
    expect(box).to_contain_text("add an encoder: encoders busy 95%")
    expect(box).to_contain_text("TTFT p90")
    expect(box).to_contain_text("no prefill or decode worker is switched")
    expect(page.locator("#rec-pools tbody tr")).to_have_count(2)  # prefill and decode only
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    assert serious_violations(page) == []
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "rebalance-encoders.png"), full_page=True)
    assert errors == []
