"""The planner's reasons agree with the figures shown beside them: a small per-device capacity reads as in
the table (0.37, not "0"), latency figures name the window they cover, and split utilisations, taken from
the smoothed loads, say they are smoothed (they lag this evaluation's own utilisations in the table)."""

from controlplane.rebalance.planner.core import (
    FleetView,
    PlannerConfig,
    PlannerState,
    PoolLoad,
    Slo,
    evaluate,
    figure,
)

SLO = Slo(ttft_p90_s=0.5, itl_p90_s=0.05)


def _view(ttft_p90_s: float) -> FleetView:
    """The walkthrough's 2P:1D: a prefill pool far over its SLO whose TTFT is falling."""
    prefill = PoolLoad(
        workers=2, request_rate=0.5, input_tokens_per_s=76.0, cached_tokens_per_s={"device": 47.0},
        ttft_p90_s=ttft_p90_s,
    )  # fmt: skip
    decode = PoolLoad(workers=1, request_rate=0.5, output_tokens_per_s=1.55, itl_p90_s=0.576)
    return FleetView(current=(2, 1), prefill=prefill, decode=decode, budget=3, slo=SLO, window_s=120.0)


def test_reasons_match_the_table_and_name_their_window():
    first, state = evaluate(_view(19.167), PlannerState(), 1000.0)
    table = first.pools["prefill"]  # 14.5 computed tokens/s per device at 19.167 s: 0.378 at 0.5 s
    assert "each device serves 14.5 at TTFT p90 19.167 s over the last 120 s" in first.reasons[0]
    assert f"so {figure(table.per_device_capacity)} at the SLO" in first.reasons[0]
    assert figure(table.per_device_capacity) == "0.378" and "so 0 at" not in first.reasons[0]

    rec, _ = evaluate(_view(5.8), state, 1015.0)  # latency fell: the smoothed load still lags it
    table = rec.pools["prefill"]
    prefill_reason, decode_reason, split_reason = rec.reasons[:3]
    assert "TTFT p90 5.800 s over the last 120 s" in prefill_reason
    assert f"utilisation {table.utilisation:.0%}" in prefill_reason
    assert "ITL p90 0.576 s over the last 120 s" in decode_reason
    smoothed = f"2P:1D (smoothed over ~{PlannerConfig().smoothing_s:g} s: prefill "
    assert smoothed in split_reason, split_reason
    shown = int(split_reason.split("prefill ")[1].split("%")[0])
    assert shown > round(table.utilisation * 100)  # smoothed: above this evaluation's, as it lags the fall


def test_figure_keeps_what_the_table_shows():
    assert [figure(v) for v in (0.0, 0.3654, 14.2, 99.94, 2000.4)] == ["0", "0.365", "14.2", "99.9", "2,000"]


def test_a_need_beyond_the_fleet_says_add_capacity_and_the_smoothed_utilisations_are_given():
    """The walkthrough's prefill pool needs more devices than the router's 3: no split can meet both SLOs,
    and the recommendation says "add capacity" with the numbers; the smoothed utilisation the split was
    chosen on is returned per pool beside this evaluation's own."""
    first, state = evaluate(_view(19.167), PlannerState(), 1000.0)
    rec, _ = evaluate(_view(5.8), state, 1015.0)
    need = rec.pools["prefill"].needed_devices + rec.pools["decode"].needed_devices
    assert need > 3 and rec.devices_short == need - 3
    assert rec.capacity_advice.startswith(f"add capacity: with 20% headroom the pools need {need} device(s)")
    assert f"and the router has 3, so no split of its devices meets both SLOs; add {need - 3} device(s)" in (
        rec.capacity_advice
    )
    assert rec.to_dict()["devices_short"] == need - 3
    smoothed = rec.to_dict()["smoothed_utilisation"]
    assert smoothed["prefill"] > rec.pools["prefill"].utilisation  # lags the fall, as the split reason says
    shown = int(rec.reasons[2].split("prefill ")[1].split("%")[0])
    assert abs(shown - smoothed["prefill"] * 100) <= 0.5  # the reason's figure, rounded

    fits = FleetView(
        current=(2, 1),
        prefill=PoolLoad(workers=2, request_rate=0.5, input_tokens_per_s=10.0, ttft_p90_s=0.1),
        decode=PoolLoad(workers=1, request_rate=0.5, output_tokens_per_s=1.0, itl_p90_s=0.01),
        budget=3, slo=SLO, window_s=120.0,
    )  # fmt: skip
    ok, _ = evaluate(fits, PlannerState(), 1000.0)
    assert ok.devices_short == 0 and ok.capacity_advice == ""
