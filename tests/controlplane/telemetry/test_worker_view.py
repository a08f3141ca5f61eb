"""The worker page's live view from a real Prometheus (Debian's package) scraping a worker's real /metrics
through the control plane's service discovery: its history (one range query) and its pushed points (one
instant query for every watched worker) equal what the worker's own counters give; a figure without series
is absent, never 0; a TSDB that does not answer makes every point say since when."""

from __future__ import annotations

import time

import pytest
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory

from controlplane.telemetry import services, watchers, worker_view

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
SLOW_S = 120  # a poll's bound on the loaded 2-core machine (a scrape and a rule evaluation every second)


def wait_for(what: str, check, timeout: float = SLOW_S):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return got


def test_history_and_points_equal_the_workers_counters_and_say_when_the_tsdb_is_down(
    tsdb, asgi_server, fake_worker, personas, api_as, settings
):
    settings.TELEMETRY_PUBLISH_INTERVAL_S = 1.0
    fake = fake_worker()
    fake.counters.update({"device": 100, "host": 100, "storage": 0})
    fake.prompt_tokens = 1000
    worker = EngineWorkerFactory(name="w-0", url=fake.url, host=HostFactory(name=AGENT_HOST), role="mixed")
    idle = EngineWorkerFactory(name="w-idle", url="http://127.0.0.1:9/", role="mixed")  # never scraped
    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped("w-0")
    time.sleep(2)  # scrapes of the first counters: the increase below is inside the 1 min rate window
    fake.counters.update({"device": 400, "host": 400, "storage": 200})
    fake.prompt_tokens = 2000

    def rates():
        figures = worker_view.points(["w-0"])["w-0"]["figures"]
        # the raw counters' window and the recording rules' 1 min rate (evaluated a little later)
        return figures if figures.get("hit_rate_storage") and figures.get("cached_device_per_s") else None

    figures = wait_for("the hit rate of the counters' increase", rates)
    # 1000 prompt tokens since the first scrapes, 300 + 300 + 200 of them from cache: the hit rate over the
    # window and each tier's part of it, exactly
    assert figures["hit_prompt_tokens"] == 1000
    assert figures["hit_rate"] == pytest.approx(800 / 1000)
    assert figures["hit_rate_device"] == pytest.approx(300 / 1000)
    assert figures["hit_rate_host"] == pytest.approx(300 / 1000)
    assert figures["hit_rate_storage"] == pytest.approx(200 / 1000)
    assert figures["host_pool_use"] == pytest.approx(1024 / 4096)
    assert figures["cached_device_per_s"] > 0 and figures["num_running_reqs"] == 0
    # no new first token in the window: no TTFT quantile (a quantile of nothing), and no 0 in its place
    assert "ttft_p50_s" not in figures and "itl_p50_s" not in figures
    assert "prefetch_in_flight" not in figures  # the worker exports no prefetch counter

    history = worker_view.history("w-0", window_s=120)
    assert history["unavailable"] is None and history["step_s"] == 1.0
    assert len(history["ts"]) == 121 and history["ts"][-1] <= time.time()
    pool = history["series"]["host_pool_use"]
    assert pool[0] is None  # before the first scrape: a gap, never 0
    assert pytest.approx(0.25) in pool
    assert all(v is None for v in history["series"]["ttft_p50_s"])

    got = api_as("viewer").get(f"/api/v1/telemetry/workers/{worker.pk}/series/?window_s=60")
    assert got.status_code == 200 and len(got.json()["ts"]) == 61
    bad = api_as("viewer").get(f"/api/v1/telemetry/workers/{worker.pk}/series/?window_s=5")
    assert bad.status_code == 400 and "window_s" in bad.json()["error"]["detail"]

    # the publisher queries only the watched workers, once for all of them
    watchers.change([worker.pk, idle.pk], [])
    try:
        sent = services.publish_workers()
        assert set(sent) >= {worker.pk, idle.pk}
        assert sent[worker.pk]["figures"]["host_pool_use"] == pytest.approx(0.25)
        assert sent[idle.pk]["figures"] == {} and sent[idle.pk]["unavailable"] is None
        assert sent[worker.pk]["ts"] % 1.0 == 0  # on the history's grid

        tsdb.server.kill()
        down = services.publish_workers()[worker.pk]
        assert down["figures"] == {} and down["unavailable"].startswith("metrics unavailable since ")
        history = worker_view.history("w-0", window_s=60)
        assert history["unavailable_since"] is not None
        assert set(history["series"]["host_pool_use"]) == {None}
    finally:
        watchers.change([], [worker.pk, idle.pk])
    assert worker.pk not in watchers.watched()
