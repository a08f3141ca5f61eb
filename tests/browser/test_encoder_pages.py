"""An EPD encoder in the console, in real headless Chromium against daphne: a real encoder service (the tiny
LLaVA's vision tower on CPU) encodes images and a real Prometheus scrapes its own /metrics through the
control plane's service discovery; the worker page charts images/s, mean encode time per image, busy share
and the embedding cache hit rate instead of the KV-cache charts (absent, with a note); the fleet page shows
the encoders as their own pool."""

import os
import re
import sys
import time
from pathlib import Path

import pytest
from console_testlib import serious_violations
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory

from engine.model.vlm.processor import open_image, preprocess
from engine.server.args import parse_args
from engine.server.encoder_server import EncoderService

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from vlm_testlib import png, save_tiny_llava  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SHOTS = os.environ.get("KVFLEET_SCREENSHOTS")  # a folder: each page is saved there to be looked at


def test_encoder_worker_page_and_fleet_pool_show_image_figures_not_kv(
    tsdb, asgi_server, console_page, personas, tmp_path, fleet_publisher
):
    from cp_fakes import MetricsEndpoint
    from playwright.sync_api import expect

    save_tiny_llava(tmp_path, seed=3)
    service = EncoderService(parse_args(["--model-path", str(tmp_path), "--encoder-only", "--device", "cpu"]))
    processor = service.vlm.processor
    endpoint = MetricsEndpoint(service.metrics_text)  # its /metrics, scraped by the TSDB

    def images(*seeds):
        return [preprocess(open_image(png(s), 4096), processor) for s in seeds]

    host = HostFactory(name=AGENT_HOST)
    enc = EngineWorkerFactory(name="enc-0", url=endpoint.url, host=host, role="encoder")
    EngineWorkerFactory(name="enc-1", url="http://enc-1.local:30000", host=host, role="encoder")  # silent
    EngineWorkerFactory(name="gpu-0", url="http://gpu-0.local:30000", host=host, role="mixed")
    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped("enc-0")  # scraped before it encodes: its 1 min figures see the images
    service.embed(images(1, 2, 3, 4))  # 4 misses, 4 images through the vision tower
    time.sleep(2)  # a scrape in between
    service.embed(images(1, 2, 5, 6))  # 2 hits from the LRU, 2 new images encoded

    page, errors = console_page("vera", "viewer")
    pool = page.locator("#pools [data-pool=encoder]")  # the fleet page: from the TSDB
    expect(pool).to_contain_text("Encoder pool")
    expect(pool).to_contain_text("1 of 2 encoders reporting")
    expect(pool.locator("[data-f=encoder_images_per_s]")).to_have_text(re.compile(r"^0\.\d+ images/s$"))
    expect(pool.locator("[data-f=mm_embedding_cache_hit_rate]")).to_have_text("25 %")
    expect(pool.locator("[data-f=mm_global_cache_hit_rate]")).to_have_attribute(
        "title", "no encoder runs with --enable-mm-global-cache"
    )
    assert pool.locator("[data-f=encode_s_per_image]").inner_text() not in ("", "—")
    expect(pool.locator("[data-f=num_running_reqs], [data-spark]")).to_have_count(0)  # no KV figures
    expect(page.locator("#pools [data-pool=regular]")).to_contain_text("0 of 1 workers reporting")
    row = page.locator(f"#workers tr[data-worker='{enc.pk}']")
    expect(row.locator("td[data-f=role]")).to_have_text("encoder")
    expect(row.locator("td[data-f=ttft_text]")).to_have_attribute(
        "title", re.compile("an EPD encoder serves no tokens")
    )
    assert page.evaluate("document.documentElement.scrollWidth") == 1280
    assert serious_violations(page) == []
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "fleet-encoder-pool.png"), full_page=True)

    page.goto(f"{asgi_server}/workers/{enc.pk}/")  # the worker page: from the TSDB too
    expect(page.get_by_test_id("encoder-note")).to_contain_text("do not apply and are not shown")
    expect(page.get_by_test_id("kv-absent")).to_contain_text("an encoder holds no KV")
    kv_only = ("#chart-cached", "#chart-hits", "#chart-pool", "#chart-ttft", "#hicache", "#breaker-state")
    for kv in kv_only:
        expect(page.locator(kv)).to_have_count(0)
    expect(page.locator(".chart .uplot")).to_have_count(4)

    def legend(chart, label):
        return page.locator(f"{chart} .u-legend .u-series").filter(has_text=label)

    # the newest point's last minute holds every lookup: 2 hits of 8
    expect(legend("#chart-mm-hits", "local LRU")).to_contain_text("25 %", timeout=120_000)
    expect(legend("#chart-images", "images/s")).to_contain_text(re.compile(r"0\.\d+ images/s"))
    expect(legend("#chart-mm-hits", "global")).to_contain_text("–")  # no --enable-mm-global-cache
    assert legend("#chart-encode", "mean per image").locator(".u-value").inner_text() not in ("", "–")
    assert serious_violations(page) == []
    if SHOTS:
        page.screenshot(path=os.path.join(SHOTS, "worker-encoder.png"), full_page=True)

    assert errors == []
