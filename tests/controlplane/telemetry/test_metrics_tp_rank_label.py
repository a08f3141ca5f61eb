"""A worker's /metrics carries upstream's ``tp_rank`` label where upstream's collectors have it (the
scheduler's gauges and the L3 storage metrics; rank 0 reports), keeps SGLang's names, and the control
plane reads the same figures from it."""

from prometheus_client.parser import text_string_to_metric_families

from engine.server.metrics import EngineMetrics

STATE = {
    "num_running_reqs": 2,
    "num_waiting_reqs": 3,
    "num_used_tokens": 250,
    "max_total_num_tokens": 1000,
    "cache_hit_rate": 0.25,
    "hicache": True,
    "cache_stats": {
        "host_used_tokens": 40, "host_total_tokens": 2000, "device_hit_tokens": 64, "prefetched_tokens": 32,
        "backuped_tokens": 48,
        "histograms": [{"metric": "prefetch_pgs", "storage_backend": "file", "buckets": [["1.0", 1],
                        ["+Inf", 1]], "sum": 1.0}],
    },
}  # fmt: skip


def _labels(text: str) -> dict[str, set[tuple]]:
    """Metric family -> the label names of its samples (``le`` aside)."""
    out: dict[str, set[tuple]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(family.name, set()).add(tuple(sorted(k for k in s.labels if k != "le")))
    return out


def test_scheduler_gauges_and_storage_metrics_carry_tp_rank_0_request_metrics_do_not():
    metrics = EngineMetrics("smollm2", lambda: STATE)
    metrics.num_requests.labels("smollm2").inc()
    metrics.on_first_token(0.1)
    text = metrics.render().decode()
    labels = _labels(text)
    ranked = ("model_name", "tp_rank")
    for name in ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "max_total_num_tokens",
                 "token_usage", "cache_hit_rate", "prefetched_tokens", "backuped_tokens"):  # fmt: skip
        assert labels[f"sglang:{name}"] == {ranked}, name
    assert labels["sglang:prefetch_pgs"] == {("model_name", "storage_backend", "tp_rank")}
    for name in ("num_requests", "time_to_first_token_seconds", "cached_tokens"):
        assert all("tp_rank" not in names for names in labels[f"sglang:{name}"]), name
    assert 'sglang:num_queue_reqs{model_name="smollm2",tp_rank="0"} 3.0' in text
    assert 'sglang:cache_hit_rate{model_name="smollm2",tp_rank="0"} 0.25' in text


def test_dp_attention_gauges_have_one_series_per_dp_rank_and_the_control_plane_sums_them():
    from controlplane.telemetry.samples import _add

    rank1 = {**STATE, "num_running_reqs": 5, "num_used_tokens": 100, "cache_hit_rate": 0.75}
    metrics = EngineMetrics("smollm2", lambda: STATE, dp_states=[lambda: STATE, lambda: rank1])
    text = metrics.render().decode()
    labels = _labels(text)
    for name in (
        "num_running_reqs",
        "num_queue_reqs",
        "max_total_num_tokens",
        "cache_hit_rate",
        "prefetched_tokens",
    ):
        assert labels[f"sglang:{name}"] == {("dp_rank", "model_name", "tp_rank")}, name
    assert 'sglang:num_running_reqs{dp_rank="1",model_name="smollm2",tp_rank="1"} 5.0' in text
    for rank, rate in ((0, 0.25), (1, 0.75)):  # each rank's last prefill batch, not one shared series
        assert (
            f'sglang:cache_hit_rate{{dp_rank="{rank}",model_name="smollm2",tp_rank="{rank}"}} {rate}' in text
        )
    sample: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            _add(sample, {"__name__": s.name, **s.labels}, s.value)
    # the planner's and calibration's reading of the worker: L1 of both DP ranks, cache hits of both
    assert sample["max_total_num_tokens"] == 2000 and sample["num_used_tokens"] == 350
    assert sample["cached_tokens_device"] == 128
