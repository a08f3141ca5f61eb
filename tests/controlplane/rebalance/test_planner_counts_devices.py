"""The P:D planner counts devices, not workers: a worker of tp N spans N devices, so a TP-2 worker that
switches roles moves two devices, splits are the ones whole workers can form, capacity is per device, and
a fleet of TP-2 workers gets the same device split as twice as many TP-1 workers under the same traffic."""

import pytest

from controlplane.rebalance.planner.core import (
    DECODE,
    PREFILL,
    FleetView,
    PlannerConfig,
    PlannerState,
    PoolLoad,
    PoolWorker,
    Slo,
    evaluate,
    split_plans,
)

INSTANT = PlannerConfig(persist_s=0.0, smoothing_s=0.0)  # decide on each evaluation alone
SLO = Slo(ttft_p90_s=0.5, itl_p90_s=0.05)


def _fleet(tp: int, n_prefill: int, n_decode: int) -> tuple[PoolWorker, ...]:
    return tuple(PoolWorker(f"p{i}", PREFILL, tp) for i in range(n_prefill)) + tuple(
        PoolWorker(f"d{i}", DECODE, tp) for i in range(n_decode)
    )


def _view(members: tuple[PoolWorker, ...], ttft_s: float = 1.5, itl_s: float = 0.01) -> FleetView:
    """Prefill-heavy traffic (TTFT 3x its SLO, ITL a fifth of its) on the pools of ``members``."""
    devices = {r: sum(m.devices for m in members if m.role == r) for r in (PREFILL, DECODE)}
    count = {r: sum(m.role == r for m in members) for r in (PREFILL, DECODE)}
    prefill = PoolLoad(
        workers=count[PREFILL], devices=devices[PREFILL], input_tokens_per_s=4000, ttft_p90_s=ttft_s
    )
    decode = PoolLoad(
        workers=count[DECODE], devices=devices[DECODE], output_tokens_per_s=400, itl_p90_s=itl_s
    )
    current = (devices[PREFILL], devices[DECODE])
    return FleetView(current, prefill, decode, budget=sum(current), slo=SLO, workers=members)


def test_tp2_workers_only_form_even_device_splits():
    plans = split_plans(_fleet(2, 1, 3), budget=8)
    assert sorted(plans) == [(2, 6), (4, 4), (6, 2)]  # never 3:5 or 5:3: half a worker cannot move
    moves, roles = plans[(4, 4)]
    assert moves == 1 and roles.count(PREFILL) == 2


def test_mixed_tp_sizes_reach_a_split_with_the_fewest_role_changes():
    members = (PoolWorker("p0", PREFILL, 1), PoolWorker("d0", DECODE, 2), PoolWorker("d1", DECODE, 1))
    plans = split_plans(members, budget=4)
    assert sorted(plans) == [(1, 3), (2, 2), (3, 1)]
    # 2:2 by moving d1 (TP 1) to prefill, not by swapping p0 and d0 (two changes)
    assert plans[(2, 2)] == (1, (PREFILL, DECODE, PREFILL))


def test_a_tp2_worker_switching_roles_moves_two_devices():
    rec, _ = evaluate(_view(_fleet(2, 1, 2)), PlannerState(), 1000.0, INSTANT)
    out = rec.to_dict()
    assert out["unit"] == "devices" and out["status"] == "change"
    assert out["current"] == {"prefill": 2, "decode": 4} and out["recommended"] == {"prefill": 4, "decode": 2}
    assert out["current_workers"] == {"prefill": 1, "decode": 2}
    assert out["recommended_workers"] == {"prefill": 2, "decode": 1}
    assert out["moves"] == [{"worker": "d1", "from_role": DECODE, "to_role": PREFILL, "devices": 2}]
    assert out["summary"] == (
        "Move 2 device(s) from decode to prefill (1 worker(s): d1 (TP 2)): 2P:4D -> 4P:2D devices."
    )
    pre = out["pools"][PREFILL]
    assert (pre["devices"], pre["workers"], pre["warm_devices"], pre["warm_workers"]) == (2, 1, 2, 1)
    assert pre["per_device_load"] == pytest.approx(4000 / 2)  # one warm worker's load over its 2 devices
    assert pre["per_device_capacity"] == pytest.approx(2000 * 0.5 / 1.5)
    assert pre["needed_devices"] == 8  # ceil(4000 / (666.7 * 0.8 headroom)): devices, not workers
    assert "each device serves 2,000" in rec.reasons[0] and "on 2 device(s)" in rec.reasons[0]


def test_tp2_workers_get_the_device_split_of_twice_as_many_tp1_workers():
    """Loads of 4 prefill devices and 2 decode devices at 100 %: 4:2 is best for either fleet."""
    tp2, _ = evaluate(_view(_fleet(2, 1, 2), 1.0, 0.025), PlannerState(), 1000.0, INSTANT)
    tp1, _ = evaluate(_view(_fleet(1, 2, 4), 1.0, 0.025), PlannerState(), 1000.0, INSTANT)
    assert tp2.current == tp1.current == (2, 4)
    assert tp2.recommended == tp1.recommended == (4, 2)
    assert tp1.recommended_workers == (4, 2) and tp2.recommended_workers == (2, 1)
    assert tp2.pools[PREFILL].utilisation == pytest.approx(tp1.pools[PREFILL].utilisation)


def test_a_split_between_two_tp2_steps_is_never_recommended():
    """Traffic whose best device split is 3:3 on a fleet of TP-2 workers: the planner picks among 2:4 and
    4:2 (what whole workers form), never 3:3."""
    view = _view(_fleet(2, 1, 2), ttft_s=0.75, itl_s=0.0375)
    rec, _ = evaluate(view, PlannerState(), 1000.0, INSTANT)
    assert rec.recommended in {(2, 4), (4, 2)} and sum(rec.recommended) == 6
    tp1, _ = evaluate(_view(_fleet(1, 2, 4), ttft_s=0.75, itl_s=0.0375), PlannerState(), 1000.0, INSTANT)
    assert tp1.recommended == (3, 3)  # what TP-1 workers can form
