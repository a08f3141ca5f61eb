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
