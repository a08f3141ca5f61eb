"""The readers moved to PromQL give the workers' own numbers: a rebalance's SLO gate (p90 TTFT and ITL over
the soak window) and calibration's measured tokens per tier, read from a real Prometheus (Debian's package)
scraping two workers' real exporters (the engine's ``EngineMetrics`` over HTTP) through the control plane's
service discovery, equal the same figures computed from the workers' raw /metrics counters."""

from __future__ import annotations

import time

import pytest
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory, RouterFactory
from prometheus_client.parser import text_string_to_metric_families

from controlplane.capacity import calibration
from controlplane.capacity.models import RecordedRequest
from controlplane.rebalance.models import Rebalance
from controlplane.rebalance.services import slo
from controlplane.telemetry import samples
from controlplane.telemetry.metrics import histogram_quantile
from engine.server.metrics import EngineMetrics

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
MODEL = "smollm2"
SLOW_S = 120  # a poll's bound on the loaded 2-core machine (a scrape every second)
TIERS = {"device": "l1", "host": "l2", "storage": "l3"}


class Exporter:
    """One worker's real metric registry, driven as its scheduler drives it."""

    def __init__(self):
        self.state = {
            "num_running_reqs": 0,
            "num_waiting_reqs": 0,
            "num_used_tokens": 0,
            "max_total_num_tokens": 1000,
            "hicache": {},
            "cache_stats": {"device_hit_tokens": 0, "host_hit_tokens": 0, "storage_hit_tokens": 0},
        }
        self.metrics = EngineMetrics(MODEL, lambda: self.state)

    def serve(self, requests: int, ttft_s: float, itl_s: float, cached: dict[str, int]) -> None:
        m = self.metrics
        m.prompt_tokens.labels(MODEL).inc(requests * 500)
        for tier, tokens in cached.items():
            self.state["cache_stats"][f"{tier}_hit_tokens"] += requests * tokens
        for _ in range(requests):
            m.on_first_token(ttft_s)
            for _ in range(3):
                m.on_inter_token(itl_s)

    def text(self) -> str:
        return self.metrics.render().decode()


def raw_buckets(texts: list[str]) -> dict[str, dict[str, float]]:
    """The watched histograms summed over the workers' /metrics texts: {family: {le: count}}."""
    out: dict[str, dict[str, float]] = {family: {} for family in slo.FAMILIES.values()}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in out:
                    le = sample.labels["le"]
                    out[sample.name][le] = out[sample.name].get(le, 0.0) + sample.value
    return out


def raw_counter(text: str, name: str, **labels) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def wait_for(what: str, check, explain=lambda: ""):
    deadline = time.monotonic() + SLOW_S
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {explain()}"
        time.sleep(0.5)
    return got


def test_the_slo_gate_and_calibration_from_promql_equal_the_raw_counters(tsdb, asgi_server, personas):
    from cp_fakes import MetricsEndpoint

    exporters = {"p1": Exporter(), "d1": Exporter()}
    exporters["d1"].serve(40, 3.0, 0.2, {"device": 100})  # before the soak: in no window
    endpoints = {name: MetricsEndpoint(e.text) for name, e in exporters.items()}
    host = HostFactory(name=AGENT_HOST)
    router = RouterFactory(mode="pd")
    workers = {
        name: EngineWorkerFactory(name=name, url=endpoints[name].url, host=host, router=router, role=role)
        for name, role in (("p1", "prefill"), ("d1", "decode"))
    }
    rb = Rebalance.objects.create(
        router=router, before_prefill=1, before_decode=1, target_prefill=1, target_decode=1, soak_s=5,
        idle_timeout_s=60, slo={"max_ttft_s": 10.0, "max_itl_s": 10.0},
    )  # fmt: skip
    tsdb.start(asgi_server, personas["viewer"][1])
    tsdb.wait_scraped("p1", "d1")

    def scraped_now():  # the TSDB's newest scrape holds the workers' counters as they are now
        texts = [e.text() for e in exporters.values()]
        snap = slo.snapshot(rb)
        return (snap, texts) if snap == raw_buckets(texts) and snap[slo.FAMILIES["max_ttft_s"]] else None

    def differ():
        return f"PromQL {slo.snapshot(rb)} raw {raw_buckets([e.text() for e in exporters.values()])}"

    baseline, before = wait_for("the soak's baseline equal to the raw buckets", scraped_now, differ)
    before_d1 = exporters["d1"].text()
    recorded_from = time.time()
    RecordedRequest.objects.create(
        worker=workers["d1"], pool="decode", timestamp_ms=round(recorded_from * 1000) + 1,
        input_length=500, output_length=4, hash_ids=[1], block_tokens=16,
    )  # fmt: skip
    # the soak window: 9 fast requests and 3 slow ones on d1, 5 on p1
    exporters["d1"].serve(9, 0.04, 0.01, {"device": 200, "host": 100})
    exporters["d1"].serve(3, 0.9, 0.03, {"storage": 50})
    exporters["p1"].serve(5, 0.2, 0.02, {"device": 10})
    _, after = wait_for("the TSDB's scrape of the soak's requests", scraped_now, differ)

    raw0, raw1 = raw_buckets(before), raw_buckets(after)
    expected = {
        key: histogram_quantile(0.9, [(float(le), c - raw0[f].get(le, 0.0)) for le, c in raw1[f].items()])
        for key, f in slo.FAMILIES.items()
    }
    assert slo.p90s(rb, baseline) == expected  # exactly the raw counters' window quantiles
    assert 0.04 < expected["max_ttft_s"] <= 1.0 and expected["max_itl_s"] is not None
    assert slo.breach(rb, baseline) == ""
    rb.slo = {"max_ttft_s": expected["max_ttft_s"] / 2}
    assert slo.breach(rb, baseline) == (
        f"TTFT p90 {expected['max_ttft_s']:.3f}s over the soak window exceeds "
        f"max_ttft_s={expected['max_ttft_s'] / 2:g}s"
    )

    after_d1 = exporters["d1"].text()
    history = samples.worker_samples(["d1"], 3600)["d1"]
    row = calibration._worker(workers["d1"], "decode", 16, history)
    cached = "sglang:cached_tokens_total"
    assert row["measured_tiers"] == {
        tier: raw_counter(after_d1, cached, cache_source=source)
        - raw_counter(before_d1, cached, cache_source=source)
        for source, tier in TIERS.items()
    }
    assert row["measured_tiers"] == {"l1": 9 * 200, "l2": 9 * 100, "l3": 3 * 50}
    prompt = "sglang:prompt_tokens_total"
    assert row["measured_prompt_tokens"] == raw_counter(after_d1, prompt) - raw_counter(before_d1, prompt)
    assert row["live"]["l1_tokens"] == 1000
    for endpoint in endpoints.values():
        endpoint.stop()
