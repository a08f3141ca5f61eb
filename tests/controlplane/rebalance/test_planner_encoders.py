"""The P:D planner and EPD encoders: encoders are their own pool, never in a split or a move, and the
planner says "add an encoder" when they are busy (encode seconds per wall second) while prefill waits."""

import time

import pytest
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory, RouterFactory

from controlplane.rebalance.planner.core import (
    PlannerConfig,
    PoolLoad,
    Slo,
    encoder_advice,
)
from controlplane.rebalance.planner.service import plan
from controlplane.rebalance.planner.window import encoder_load

SLO = Slo(ttft_p90_s=0.5, itl_p90_s=0.05)
CFG = PlannerConfig()


def _samples(images: list[float], seconds: list[float], step: float = 10.0) -> list[dict]:
    return [
        {"ts": 1000.0 + i * step, "encoder_images_total": n, "encoder_encode_seconds_total": s}
        for i, (n, s) in enumerate(zip(images, seconds, strict=True))
    ]


def test_encoder_load_sums_images_and_encode_seconds_per_second_and_skips_restarts():
    load = encoder_load(
        [
            _samples([0, 50, 100], [0.0, 9.0, 18.0]),  # 5 images/s, 0.9 s/s over 20 s
            _samples([0, 10], [0.0, 1.0]),  # 1 image/s, 0.1 s/s
            _samples([500, 3], [60.0, 0.5]),  # restarted: left out
            _samples([7], [1.0]),  # one sample: left out
        ]
    )
    assert load.workers == 2
    assert load.images_per_s == pytest.approx(6.0) and load.busy_s_per_s == pytest.approx(1.0)
    assert load.utilisation == pytest.approx(0.5)
    assert encoder_load([_samples([1], [1.0])]) is None


def test_busy_encoders_while_prefill_misses_its_ttft_slo_say_add_an_encoder():
    busy = encoder_load([_samples([0, 90], [0.0, 9.0])])  # 90 % busy
    prefill = PoolLoad(workers=1, ttft_p90_s=1.2)
    out = encoder_advice(busy, 1, prefill, SLO, CFG)
    assert out["advice"] == "add_encoder" and out["message"].startswith("add an encoder")
    assert "TTFT p90 1.2 s is over its SLO 0.5 s" in out["message"]
    assert out["utilisation"] == pytest.approx(0.9) and out["encode_s_per_image"] == pytest.approx(0.1)
    queued = PoolLoad(workers=1, ttft_p90_s=0.1, queue_reqs=3.0)
    assert encoder_advice(busy, 1, queued, SLO, CFG)["advice"] == "add_encoder"


def test_busy_encoders_with_prefill_not_waiting_or_idle_encoders_hold():
    busy = encoder_load([_samples([0, 90], [0.0, 9.0])])
    fast = PoolLoad(workers=1, ttft_p90_s=0.1)
    assert encoder_advice(busy, 1, fast, SLO, CFG)["advice"] == "hold"
    idle = encoder_load([_samples([0, 10], [0.0, 1.0])])  # 10 % busy
    slow = PoolLoad(workers=1, ttft_p90_s=2.0, queue_reqs=5.0)
    out = encoder_advice(idle, 1, slow, SLO, CFG)
    assert out["advice"] == "hold" and "below the limit" in out["message"]
    assert encoder_advice(None, 2, slow, SLO, CFG)["advice"] == "insufficient_data"
    assert encoder_advice(None, 0, slow, SLO, CFG) is None  # no encoder: nothing to say


@pytest.mark.django_db
def test_plan_keeps_encoders_out_of_the_split_and_advises_on_them(personas, tsdb):
    host = HostFactory(name=AGENT_HOST)
    router = RouterFactory(mode="pd")
    for name, role in (("p1", "prefill"), ("d1", "decode"), ("e1", "encoder"), ("e2", "encoder")):
        EngineWorkerFactory(name=name, url=f"http://{name}.local:1", host=host, router=router, role=role)
    now = time.time()
    scrapes = []
    for i, ts in enumerate((now - 30, now - 10)):  # each encoder 95 % busy over the 20 s
        for name in ("e1", "e2"):
            metrics = {"encoder_images_total": 100.0 * i, "encoder_encode_seconds_total": 19.0 * i}
            scrapes.append((name, ts, _text(metrics)))
    tsdb.serve(scrapes)  # the TSDB holds them as its scrapes of the encoders
    out = plan(router, now=now)
    assert out["current"] == {"prefill": 1, "decode": 1}  # encoders are no P or D device
    assert out["budget"] == 2
    assert all(m["worker"] not in ("e1", "e2") for m in out["moves"])
    enc = out["encoders"]
    assert enc["workers"] == 2 and enc["warm_workers"] == 2
    assert enc["images_per_s"] == pytest.approx(10.0) and enc["utilisation"] == pytest.approx(0.95)
    assert enc["advice"] == "hold"  # busy, but the prefill pool reports no wait (no figures)


def _text(metrics: dict) -> str:
    return "".join(
        f'# TYPE sglang:{k} counter\nsglang:{k}{{model_name="m"}} {v}\n' for k, v in metrics.items()
    )
