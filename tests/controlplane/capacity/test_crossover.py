"""The measured crossover: known cost lines in, known crossover and recommendation out; and the REST endpoint
reading a worker's real exporter (``EngineMetrics`` over a real ``TransferCosts``) from a real Prometheus."""

from __future__ import annotations

import time

import pytest
from cp_factories import EngineWorkerFactory, crossover_change, ttft_histogram

from controlplane.audit.models import AuditEvent
from controlplane.capacity.crossover import (
    MIN_REQUESTS,
    costs_from_samples,
    crossover_tokens,
    fit_cost,
    ttft_verdict,
    ttft_window,
    worker_crossover,
)
from controlplane.operations.models import Operation
from controlplane.operations.services import target_step
from engine.cache.costs import TransferCosts
from engine.server.metrics import EngineMetrics

PAGE = 16
# seconds(n) = fixed + per_token * n for each operation, the numbers the tests are built from
LOAD_BACK = (0.001, 1e-6)
PREFETCH = (0.020, 10e-6)
PREFILL = (0.0005, 50e-6)
SIZES = (20, 100, 400, 1500, 3000)


def _costs(*lines: tuple[str, tuple[float, float]], sizes=SIZES, repeat: int = 2) -> TransferCosts:
    costs = TransferCosts()
    for op, (fixed, per_token) in lines:
        for n in sizes:
            for _ in range(repeat):
                costs.observe(op, n, fixed + per_token * n)
    return costs


def test_fit_recovers_a_cost_line_from_its_buckets():
    fit = fit_cost(_costs(("prefetch", PREFETCH)).snapshot()["prefetch"])
    assert fit["operations"] == 10 and fit["tokens"] == 2 * sum(SIZES)
    assert fit["fixed_s"] == pytest.approx(0.020) and fit["per_token_s"] == pytest.approx(10e-6)
    # one size only: a line through the origin (throughput), never a negative term
    one = fit_cost([{"size": "64", "count": 4, "tokens": 200, "seconds": 0.01}])
    assert one["fixed_s"] == 0 and one["per_token_s"] == pytest.approx(0.01 / 200)
    falling = fit_cost(
        [
            {"size": "16", "count": 1, "tokens": 16, "seconds": 0.02},
            {"size": "64", "count": 1, "tokens": 64, "seconds": 0.01},
        ]
    )
    assert falling["per_token_s"] == 0 and falling["fixed_s"] == pytest.approx(0.015)
    assert fit_cost([]) is None


def test_crossover_formula():
    assert crossover_tokens(0.021, 11e-6, 50e-6) == pytest.approx(0.021 / 39e-6)
    assert crossover_tokens(0.0, 1e-6, 50e-6) == 0.0  # no fixed cost: loading always wins
    assert crossover_tokens(0.001, 60e-6, 50e-6) is None  # recomputing a token is faster: never


def test_known_lines_give_the_known_crossover_and_recommendation():
    costs = _costs(("load_back", LOAD_BACK), ("prefetch", PREFETCH), ("prefill", PREFILL)).snapshot()
    current = {"prefetch_threshold": 256, "prefetch_timeout_base": 2.0, "prefetch_timeout_per_ki_token": 0.1}
    out = worker_crossover(costs, page_size=PAGE, current=current)
    l2, l3 = out["tiers"]["L2"], out["tiers"]["L3"]
    assert l2["crossover_tokens"] == pytest.approx(0.001 / 49e-6, abs=0.1) and l2["loading_wins"] == "from"
    assert l3["crossover_tokens"] == pytest.approx(0.021 / 39e-6, abs=0.1)  # 538.5 tokens
    assert l3["load_fixed_s"] == pytest.approx(0.021) and l3["load_per_token_s"] == pytest.approx(11e-6)
    assert out["recommended"] == {
        "prefetch_threshold": 544,  # 538.5 rounded up to whole 16-token pages
        "prefetch_timeout_base": 0.021,
        "prefetch_timeout_per_ki_token": round(1024 * 50e-6, 4),
    }
    assert out["changes"]["prefetch_threshold"] == {"before": 256, "after": 544}
    unknown = worker_crossover(costs, page_size=PAGE, current=None)  # the worker's config could not be read
    assert unknown["current"] is None  # not "already runs it": every recommended field is a change
    assert unknown["changes"] == {k: {"before": None, "after": v} for k, v in out["recommended"].items()}
    assert out["load_back_threshold"] == {
        "engine": 10,
        "l2_crossover_tokens": l2["crossover_tokens"],
        "configurable": False,
    }
    assert out["notes"] == []
    assert [b["size"] for b in out["measured"]["prefill"]] == ["32", "128", "512", "2048", "4096"]
    bucket = out["measured"]["prefill"][0]
    assert bucket["tokens_per_s"] == pytest.approx(20 / (0.0005 + 20 * 50e-6))


def test_an_l3_slower_than_recompute_raises_the_threshold_past_every_prefill():
    slow = (0.050, 80e-6)  # per token slower than prefill's 50 us
    costs = _costs(("load_back", LOAD_BACK), ("prefetch", slow), ("prefill", PREFILL)).snapshot()
    out = worker_crossover(costs, page_size=PAGE, current={"prefetch_threshold": 256})
    assert out["tiers"]["L3"]["loading_wins"] == "never" and out["tiers"]["L3"]["crossover_tokens"] is None
    assert out["recommended"]["prefetch_threshold"] == 4096  # the longest prefill bucket measured
    assert "slower than recomputing" in out["notes"][0]


def test_a_flat_prefill_line_recomputes_at_its_mean_cost_per_token():
    costs = _costs(("load_back", LOAD_BACK), ("prefetch", PREFETCH)).snapshot()
    costs["prefill"] = [  # the bigger bucket ran faster per pass: no slope can be read
        {"size": "64", "count": 3, "tokens": 150, "seconds": 0.3},
        {"size": "512", "count": 3, "tokens": 1500, "seconds": 0.24},
    ]
    out = worker_crossover(costs, page_size=PAGE)
    assert out["fits"]["prefill"]["per_token_s"] == 0
    assert out["tiers"]["L3"]["recompute_per_token_s"] == pytest.approx(0.54 / 1650)
    assert out["tiers"]["L3"]["crossover_tokens"] == pytest.approx(0.021 / (0.54 / 1650 - 11e-6), abs=0.1)


def test_too_few_operations_give_no_answer_and_say_why():
    costs = _costs(("load_back", LOAD_BACK), ("prefill", PREFILL), sizes=(100,), repeat=2).snapshot()
    out = worker_crossover(costs, page_size=PAGE, current=None)
    assert out["tiers"]["L2"]["crossover_tokens"] is None and out["recommended"] == {}
    assert any("load_back: 2 operation(s)" in n for n in out["notes"])
    assert any("prefetch: not measured" in n for n in out["notes"])


def test_costs_from_promql_samples_sum_per_worker_operation_and_size():
    samples = {
        "operations": [{"labels": {"worker": "w0", "operation": "prefill", "size": "64"}, "value": 3.0}],
        "tokens": [{"labels": {"worker": "w0", "operation": "prefill", "size": "64"}, "value": 150.0}],
        "seconds": [{"labels": {"worker": "w0", "operation": "prefill", "size": "64"}, "value": 0.3}],
    }
    assert costs_from_samples(samples) == {
        "w0": {"prefill": [{"size": "64", "count": 3, "tokens": 150, "seconds": 0.3}]}
    }


@pytest.mark.django_db
def test_crossover_api_reads_the_worker_exporter_from_the_tsdb_and_applies_it(tsdb, api_as, fake_worker):
    """GET answers the crossover of the worker's real exporter as Prometheus holds it; POST .../apply/
    turns the recommendation into a config revision and an idle-gated apply_config operation, which,
    driven step by step against a fake worker over HTTP, leaves the recommended values on it."""
    fake = fake_worker()
    # no agent and no operation read its config yet: the crossover reads it from the worker's /server_info
    worker = EngineWorkerFactory(
        name="w0", role="mixed", page_size=PAGE, url=fake.url, admin_key=fake.admin_key
    )
    costs = _costs(("load_back", LOAD_BACK), ("prefetch", PREFETCH), ("prefill", PREFILL))
    state = {"num_running_reqs": 0, "num_waiting_reqs": 0, "max_total_num_tokens": 1000}
    state["cache_stats"] = {"costs": costs.snapshot()}
    text = EngineMetrics("m", lambda: state).render().decode()
    assert 'sglang:kv_cost_tokens_total{model_name="m",operation="prefetch",size="512"} 800.0' in text
    tsdb.serve([(worker.name, time.time() - 5, text)])
    viewer = api_as("viewer")
    got = viewer.get("/api/v1/capacity/crossover/", {"pool": "regular"})
    assert got.status_code == 200, got.content
    assert got.json()["unavailable"] is None
    (row,) = got.json()["workers"]
    assert row["worker"] == "w0" and row["tiers"]["L3"]["crossover_tokens"] == pytest.approx(538.5, abs=0.1)
    assert row["changes"] == {
        "prefetch_threshold": {"before": 256, "after": 544},
        "prefetch_timeout_base": {"before": 2.0, "after": 0.021},
        "prefetch_timeout_per_ki_token": {"before": 0.1, "after": 0.0512},
    }
    assert row["current"] == {k: v["before"] for k, v in row["changes"].items()}
    assert row["config"]["why"] == "" and row["config"]["read_at"] is not None
    refused = viewer.get("/api/v1/capacity/crossover/", {"window_s": 1})
    assert refused.status_code == 400 and "window_s" in refused.json()["error"]["detail"]

    apply = "/api/v1/capacity/crossover/apply/"
    assert viewer.post(apply, {"worker": "w0"}, format="json").status_code == 403
    operator = api_as("operator")
    unknown = operator.post(apply, {"worker": "w9"}, format="json")
    assert unknown.status_code == 400 and "worker" in unknown.json()["error"]["detail"]
    assert unknown.json()["error"]["code"] == "validation_error"  # as every 400 that names a field
    applied = operator.post(apply, {"worker": "w0", "reason": "slow file L3"}, format="json")
    assert applied.status_code == 201, applied.content
    body = applied.json()
    assert body["changes"] == row["changes"] and body["profile"] == "crossover-w0" and body["revision"] == 1
    op = Operation.objects.get(pk=body["operation"])
    assert op.kind == "apply_config" and op.reason.startswith("slow file L3 (measured crossover of w0")
    assert "538.5 tokens" in op.reason
    target = op.targets.get()
    deadline = time.monotonic() + 30
    while (delay := target_step(target_id=target.pk)) is not None:
        assert time.monotonic() < deadline, "the apply_config target did not finish"
        time.sleep(delay)
    target.refresh_from_db()
    assert target.state == "succeeded", target.explanation
    assert fake.config["prefetch_threshold"] == 544 and fake.config["prefetch_timeout_base"] == 0.021
    assert target.before["prefetch_threshold"] != 544 and target.after["prefetch_threshold"] == 544


@pytest.mark.django_db
def test_crossover_api_without_the_tsdb_says_why_and_has_no_workers(api_as, settings):
    settings.PROMETHEUS_URL = "http://127.0.0.1:9"  # nothing listens there
    got = api_as("viewer").get("/api/v1/capacity/crossover/")
    assert got.status_code == 200, got.content
    body = got.json()
    assert body["workers"] == [] and body["unavailable"].startswith("metrics unavailable since")


def _series(le: str, *counts: float) -> dict:
    return {"labels": {"le": le}, "points": [(1000.0 + i, c) for i, c in enumerate(counts)]}


def test_ttft_window_adds_each_buckets_rise_across_a_restart():
    # two ranks' series of the same bound add up; a counter that restarted (40 -> 3) counts 3 more, not -37
    series = [
        _series("0.1", 10, 14, 30),
        _series("0.1", 0, 2),
        _series("0.5", 10, 40, 3),
        _series("+Inf", 10, 40, 3),
    ]
    window = ttft_window(series)
    assert window["requests"] == 33  # +Inf: 30 + 3
    # cumulative 22 at 0.1 s, 33 at 0.5 s: the median (rank 16.5) lies in the first bucket, 0..0.1 s
    assert window["ttft_p50_s"] == pytest.approx(0.1 * 16.5 / 22)
    assert ttft_window([]) == {"requests": 0, "ttft_p50_s": None}
    assert ttft_window([_series("+Inf", 7)]) == {"requests": 0, "ttft_p50_s": None}  # one scrape: no rise


@pytest.mark.parametrize(
    ("before", "after", "verdict", "text"),
    [
        ((40, 0.4), (40, 0.2), "helped", "It helped: TTFT p50 400 ms before, 200 ms after (-50%)."),
        (
            (40, 0.4),
            (40, 0.41),
            "no_better",
            "It did not help: TTFT p50 400 ms before, 410 ms after, within 5%",
        ),
        ((40, 0.4), (40, 0.6), "worse", "It did not help: TTFT p50 400 ms before, 600 ms after (+50%)"),
        ((40, 0.4), (19, 0.1), "not_enough_traffic_after", "Not enough traffic after the change yet: 19 of"),
        ((3, 0.4), (40, 0.1), "not_enough_traffic_before", "Too little traffic before the change"),
        ((0, None), (0, None), "not_enough_traffic_after", "Not enough traffic after the change yet: 0 of"),
    ],
)
def test_verdict_says_whether_the_change_helped(before, after, verdict, text):
    window = [{"requests": n, "ttft_p50_s": p50} for n, p50 in (before, after)]
    out = ttft_verdict(*window)
    assert out["verdict"] == verdict and out["text"].startswith(text), out
    assert (out["change"] is None) == verdict.startswith("not_enough")
    assert MIN_REQUESTS == 20  # the texts above count against it


@pytest.mark.django_db
def test_crossover_api_compares_ttft_before_and_after_the_applied_change(tsdb, api_as):
    """Each worker's ``effect``: its TTFT p50 in the window before its crossover change and after it, read
    from the TSDB's scrapes of its TTFT histogram, with the verdict; a worker with no change has none."""
    costs = _costs(("load_back", LOAD_BACK), ("prefetch", PREFETCH), ("prefill", PREFILL)).snapshot()
    state = {"num_running_reqs": 0, "num_waiting_reqs": 0, "max_total_num_tokens": 1000}
    exported = EngineMetrics("m", lambda: {**state, "cache_stats": {"costs": costs}}).render().decode()
    workers = {n: EngineWorkerFactory(name=n, role="mixed", page_size=PAGE) for n in ("w0", "w1", "w2")}
    now = time.time()
    change = {"prefetch_threshold": 544}
    op = crossover_change(
        workers["w0"], created_at=now - 900, finished_at=now - 600, before={"prefetch_threshold": 256},
        after=change,
    )  # fmt: skip
    crossover_change(workers["w1"], created_at=now - 150, finished_at=now - 120, before={}, after=change)
    slow, fast = {"0.5": 40}, {"0.5": 40, "0.1": 40}  # 40 requests at 250-500 ms, then 40 at 50-100 ms
    scrapes = [
        ("w0", now - 1500, exported + ttft_histogram({})),
        ("w0", now - 1000, exported + ttft_histogram(slow)),
        ("w0", now - 550, exported + ttft_histogram(slow)),  # after the change: its first scrape
        ("w0", now - 20, exported + ttft_histogram(fast)),
        ("w1", now - 100, exported + ttft_histogram({"0.5": 40})),
        ("w1", now - 20, exported + ttft_histogram({"0.5": 40, "0.1": 5})),
        ("w2", now - 20, exported + ttft_histogram({"0.5": 40})),
    ]
    tsdb.serve(scrapes)
    got = api_as("viewer").get("/api/v1/capacity/crossover/")
    assert got.status_code == 200, got.content
    rows = {r["worker"]: r for r in got.json()["workers"]}
    w0 = rows["w0"]["effect"]
    assert w0["operation"] == op.pk and w0["revision"] == 1
    assert w0["changes"] == {"prefetch_threshold": {"before": 256, "after": 544}}
    assert w0["applied_at"] == pytest.approx(now - 600, abs=0.01)
    assert w0["before"]["requests"] == 40 and w0["before"]["ttft_p50_s"] == pytest.approx(0.375)
    assert w0["after"]["requests"] == 40 and w0["after"]["ttft_p50_s"] == pytest.approx(0.075)
    assert w0["before"]["to"] == pytest.approx(now - 900, abs=0.01) and w0["window_s"] == 1800
    assert w0["verdict"] == "helped" and w0["change"] == pytest.approx(-0.8)
    assert w0["text"] == "It helped: TTFT p50 375 ms before, 75 ms after (-80%)."
    w1 = rows["w1"]["effect"]
    assert w1["verdict"] == "not_enough_traffic_after" and w1["after"]["requests"] == 5
    assert w1["after"]["ttft_p50_s"] == pytest.approx(0.05 + 0.05 * 0.5)  # measured, just too few
    assert rows["w2"]["effect"] is None


@pytest.mark.django_db
def test_crossover_probe_runs_the_workers_probe_and_relays_refusals(api_as, fake_worker):
    """POST .../probe/ relays the worker's CostProbeResult (audited); 400 names worker or sizes, a busy
    worker is 409 not_idle, a worker that went away 503; viewers may not probe."""
    fake = fake_worker()
    EngineWorkerFactory(name="w0", role="mixed", page_size=PAGE, url=fake.url, admin_key=fake.admin_key)
    EngineWorkerFactory(name="nokey", role="mixed", page_size=PAGE, url=fake.url + "/", admin_key="")
    probe = "/api/v1/capacity/crossover/probe/"
    assert api_as("viewer").post(probe, {"worker": "w0"}, format="json").status_code == 403
    operator = api_as("operator")
    got = operator.post(probe, {"worker": "w0", "sizes": [32], "reason": "thin traffic"}, format="json")
    assert got.status_code == 200, got.content
    body = got.json()
    assert body["worker"] == "w0" and body["page_size"] == 16
    assert {(m["operation"], m["tokens"]) for m in body["measured"]} == {("prefill", 32), ("load_back", 32)}
    assert fake.probes == [{k: v for k, v in body.items() if k != "worker"}]
    event = AuditEvent.objects.get(action="crossover_probe")
    assert event.object_repr.startswith("w0") and event.message == "thin traffic"
    cases = [
        ({"worker": "w9"}, "worker"),
        ({"worker": "nokey"}, "worker"),
        ({"worker": "w0", "sizes": [0]}, "sizes"),
        ({"worker": "w0", "sizes": []}, "sizes"),
    ]
    for bad, field in cases:
        refused = operator.post(probe, bad, format="json")
        assert refused.status_code == 400 and field in refused.json()["error"]["detail"], refused.content
    fake.busy_polls = -1
    busy = operator.post(probe, {"worker": "w0"}, format="json")
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "not_idle"
    fake.stop()
    gone = operator.post(probe, {"worker": "w0"}, format="json")
    assert gone.status_code == 503 and gone.json()["error"]["code"] == "worker_unreachable"
    assert len(fake.probes) == 1
    # refusals are audited too (a probe that timed out may still have measured on the worker)
    failed = list(AuditEvent.objects.filter(action="crossover_probe", outcome="failure").order_by("id"))
    assert "not idle" in failed[-2].message.lower() and "/hicache/costs/probe" in failed[-1].message
