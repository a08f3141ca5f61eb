"""The P:D planner through the API: router SLOs (audited PATCH), and the recommendation computed from
metrics the engine's own exporter renders (engine.server.metrics.EngineMetrics), read with PromQL from a real
Prometheus holding them as scrapes at their sample times (`Tsdb.serve`)."""

import time
from datetime import timedelta

import pytest
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory, RouterFactory
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.rebalance.models import Rebalance
from controlplane.rebalance.planner.service import plan
from engine.server.metrics import EngineMetrics

MODEL = "smollm2"


class Exporter:
    """One worker's real metric registry, driven as its scheduler would drive it."""

    def __init__(self):
        self.metrics = EngineMetrics(MODEL, lambda: self.state)
        self.state = {
            "num_running_reqs": 2,
            "num_waiting_reqs": 1,
            "num_used_tokens": 300,
            "max_total_num_tokens": 1000,
            "hicache": None,
            "cache_stats": {"device_hit_tokens": 0},
        }

    def serve(self, requests: int, prompt: int, cached: int, output: int, ttft_s: float | None, itl_s: float):
        m = self.metrics
        m.prompt_tokens.labels(MODEL).inc(requests * prompt)
        m.generation_tokens.labels(MODEL).inc(requests * output)
        m.num_requests.labels(MODEL).inc(requests)
        self.state["cache_stats"]["device_hit_tokens"] += requests * cached
        for _ in range(requests):
            if (
                ttft_s is not None
            ):  # as in the engine: a PD prefill worker records no TTFT, its decode peer does
                m.on_first_token(ttft_s)
            for _ in range(output):
                m.on_inter_token(itl_s)

    def text(self) -> str:
        return self.metrics.render().decode()


@pytest.fixture
def pd_fleet(db, personas):
    host = HostFactory(name=AGENT_HOST)
    router = RouterFactory(mode="pd", slo_ttft_p90_s=0.5, slo_itl_p90_s=0.05)
    workers = {
        name: EngineWorkerFactory(
            name=name, url=f"http://{name}.local:30000", host=host, router=router, role=role
        )
        for name, role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode"))
    }
    return router, workers, {name: Exporter() for name in workers}


def _push(tsdb, workers, exporters, t0: float, seconds: int, prefill_ttft: float):
    """Scrapes of every worker each 10 s from ``t0`` for ``seconds``, served by ``tsdb`` from then on."""
    scrapes = []
    for step in range(0, seconds + 1, 10):
        for name, worker in workers.items():
            if step:
                if worker.role == "prefill":  # 2 req/s of 1000-token prompts, 400 tokens of each cached
                    exporters[name].serve(20, 1000, 400, 1, None, 0.01)
                else:  # 1 req/s of 50 output tokens per decode worker
                    exporters[name].serve(10, 1000, 0, 50, prefill_ttft, 0.01)
            scrapes.append((name, t0 + step, exporters[name].text()))
    tsdb.serve(scrapes)


def test_router_slo_is_set_by_an_operator_audited_and_checked(api_as, db):
    router = RouterFactory(mode="pd")
    url = f"/api/v1/inventory/routers/{router.pk}/"
    assert api_as("viewer").patch(url, {"slo_ttft_p90_s": 0.4}, format="json").status_code == 403
    bad = api_as("operator").patch(url, {"slo_itl_p90_s": -1}, format="json")
    assert bad.status_code == 400 and "slo_itl_p90_s" in bad.json()["error"]["detail"]
    huge = api_as("operator").patch(url, {"slo_ttft_p90_s": 1e308}, format="json")
    assert huge.status_code == 400 and "slo_ttft_p90_s" in huge.json()["error"]["detail"]
    ok = api_as("operator").patch(url, {"slo_ttft_p90_s": 0.4, "slo_itl_p90_s": 0.04}, format="json")
    assert ok.status_code == 200 and (ok.json()["slo_ttft_p90_s"], ok.json()["slo_itl_p90_s"]) == (0.4, 0.04)
    record = AuditEvent.objects.filter(object_type="inventory.router", object_id=str(router.pk)).latest("id")
    assert record.before["slo_ttft_p90_s"] is None and record.after["slo_ttft_p90_s"] == 0.4


def test_an_overloaded_prefill_pool_gets_a_decode_worker_after_the_proposal_persists(pd_fleet, api_as, tsdb):
    router, workers, exporters = pd_fleet
    t0 = time.time() - 250  # 220 s of scrapes, in the past
    _push(tsdb, workers, exporters, t0, 220, prefill_ttft=1.5)
    rec = plan(router, now=t0 + 100)
    assert rec["status"] == "pending" and rec["current"] == {"prefill": 1, "decode": 2}, rec["reasons"]
    pre, dec = rec["pools"]["prefill"], rec["pools"]["decode"]
    assert pre["input_tokens_per_s"] == pytest.approx(2000) and pre["hit_rate"] == pytest.approx(0.4)
    assert pre["demand"] == pytest.approx(1200)  # 2000 prompt tokens/s - 800 served from cache
    assert pre["latency_p90_s"] > 1.0 and pre["slo_p90_s"] == 0.5  # the client's TTFT, seen on decode
    assert pre["per_device_capacity"] == pytest.approx(1200 * 0.5 / pre["latency_p90_s"])
    assert dec["demand"] == pytest.approx(100) and dec["workers"] == 2 and dec["warm_workers"] == 2
    assert rec["slo_source"] == "router"
    assert rec["slo_sources"] == {"ttft_p90_s": "router", "itl_p90_s": "router"}
    assert any("prefill demand 1,200 computed prompt tokens/s" in r and "40% served from cache" in r
               for r in rec["reasons"])  # fmt: skip
    held = plan(router, now=t0 + 200)  # 100 s, but only 40 s since the smoothing warmed up
    assert held["status"] == "pending", held["reasons"]
    later = plan(router, now=t0 + 221)
    assert later["status"] == "change" and later["recommended"] == {"prefill": 2, "decode": 1}, later[
        "reasons"
    ]
    assert later["summary"] == (
        "Move 1 device(s) from decode to prefill (1 worker(s): d2): 1P:2D -> 2P:1D devices."
    )
    assert later["recommended_workers"] == {"prefill": 2, "decode": 1} and later["unit"] == "devices"
    _push(tsdb, workers, exporters, time.time() - 10, 10, prefill_ttft=1.5)  # the workers report now
    got = api_as("viewer").get(f"/api/v1/inventory/routers/{router.pk}/recommendation/")
    assert got.status_code == 200 and got.json()["status"] == "change", got.json()["reasons"]
    assert got.json()["evaluated_at"] > later["evaluated_at"]


def test_cold_stale_and_non_pd(pd_fleet, api_as, tsdb):
    router, workers, exporters = pd_fleet
    t0 = time.time() - 100
    workers["d2"].role_changed_at = timezone.now() - timedelta(seconds=30)
    workers["d2"].save()
    _push(tsdb, workers, exporters, t0, 100, prefill_ttft=0.2)
    rec = plan(router, now=t0 + 100)
    dec = rec["pools"]["decode"]
    assert (dec["workers"], dec["warm_workers"]) == (2, 1)  # d2 is still warming up in its new role
    assert rec["status"] == "cooldown"
    stale = plan(router, now=t0 + 200)
    assert stale["status"] == "frozen" and "is not reporting" in stale["summary"]
    router.slo_ttft_p90_s = None  # only the ITL SLO set: TTFT is the default, and the notes say so
    router.save()
    one = plan(router, now=t0 + 100)
    assert one["slo_source"] == "router" and one["pools"]["prefill"]["slo_p90_s"] == 0.5
    assert one["slo_sources"] == {"ttft_p90_s": "default", "itl_p90_s": "router"}
    op = api_as("operator")
    url = f"/api/v1/inventory/routers/{router.pk}/"
    huge = op.patch(url, {"worker_budget": 100000}, format="json")
    assert huge.status_code == 400 and "worker_budget" in huge.json()["error"]["detail"]
    assert op.patch(url, {"worker_budget": 10000}, format="json").status_code == 200
    router.refresh_from_db()
    assert plan(router, now=t0 + 100)["budget"] == 3  # a cap: never more than the router's 3 workers
    assert op.patch(url, {"worker_budget": 2}, format="json").status_code == 200
    router.refresh_from_db()
    assert plan(router, now=t0 + 100)["budget"] == 2
    regular = RouterFactory(mode="regular")
    got = api_as("viewer").get(f"/api/v1/inventory/routers/{regular.pk}/recommendation/")
    assert got.status_code == 409 and got.json()["error"]["code"] == "not_pd"


def test_the_beat_task_plans_every_pd_router(pd_fleet, api_as):
    from django.conf import settings

    from controlplane.rebalance.planner.tasks import plan_all_task

    router, _, _ = pd_fleet
    RouterFactory(mode="regular")
    assert settings.CELERY_BEAT_SCHEDULE["rebalance-plan"]["task"] == plan_all_task.name
    assert plan_all_task.apply().get() == 1  # the PD router only
    stored = api_as("viewer").get(f"/api/v1/inventory/routers/{router.pk}/recommendation/").json()
    assert stored["router"] == router.pk and stored["status"] == "frozen"  # no worker has reported yet


def test_the_recommendation_counts_tp2_workers_as_two_devices(pd_fleet, api_as, tsdb):
    """The same traffic as above on TP-2 workers: the API reports devices (current 2P:4D, the budget 6),
    per-device capacity half the per-worker one, and moving one TP-2 decode worker moves two devices."""
    router, workers, exporters = pd_fleet
    for w in workers.values():
        w.tp_size = 2
        w.save()
    # a rebalance that reached 1P:2D (workers) long ago: the router is at its target, nothing is frozen
    Rebalance.objects.create(
        router=router, before_prefill=2, before_decode=1, target_prefill=1, target_decode=2, soak_s=5,
        idle_timeout_s=60, state="succeeded", finished_at=timezone.now() - timedelta(seconds=3600),
    )  # fmt: skip
    t0 = time.time() - 250
    _push(tsdb, workers, exporters, t0, 220, prefill_ttft=1.5)
    rec = plan(router, now=t0 + 100)
    assert rec["status"] == "pending", rec["summary"]
    assert rec["unit"] == "devices" and rec["budget"] == 6
    assert rec["current"] == {"prefill": 2, "decode": 4}
    assert rec["current_workers"] == {"prefill": 1, "decode": 2}
    pre = rec["pools"]["prefill"]
    assert (pre["devices"], pre["workers"], pre["warm_devices"]) == (2, 1, 2)
    assert pre["per_device_capacity"] == pytest.approx(1200 / 2 * 0.5 / pre["latency_p90_s"])
    later = plan(router, now=t0 + 221)
    assert later["status"] == "change", later["reasons"]
    assert later["recommended"] == {"prefill": 4, "decode": 2}
    assert later["recommended_workers"] == {"prefill": 2, "decode": 1}
    assert later["moves"] == [{"worker": "d2", "from_role": "decode", "to_role": "prefill", "devices": 2}]
    assert later["summary"].startswith("Move 2 device(s) from decode to prefill (1 worker(s): d2 (TP 2))")
    router.worker_budget = 2  # the two largest workers' devices
    router.save()
    assert plan(router, now=t0 + 100)["budget"] == 4
