"""An EPD encoder's counters, as its /metrics renders them, become the snapshot's encoder figures: images/s,
encode seconds per wall second, mean encode time per image, and hit rates of both embedding caches."""

import pytest

from controlplane.telemetry.metrics import parse_prometheus, with_rates


def encoder_text(images: int, seconds: float, hits: int, misses: int, global_counts=None) -> str:
    lines = []
    counters = {
        "encoder_images_total": images,
        "encoder_encode_seconds_total": seconds,
        "mm_embedding_cache_hits_total": hits,
        "mm_embedding_cache_misses_total": misses,
    }
    if global_counts:
        counters |= {f"mm_global_cache_{k}_total": v for k, v in global_counts.items()}
    for name, value in counters.items():
        lines += [f"# TYPE sglang:{name} counter", f'sglang:{name}{{model_name="m"}} {value}']
    return "\n".join(lines) + "\n"


def test_encoder_counters_give_images_per_s_busy_share_and_mean_encode_time():
    before = parse_prometheus(encoder_text(10, 1.0, 0, 10))
    after = with_rates(parse_prometheus(encoder_text(30, 3.0, 5, 25)), before, 10.0)
    assert after["encoder_images_per_s"] == pytest.approx(2.0)
    assert after["encoder_busy"] == pytest.approx(0.2)  # 2 s of vision tower in 10 s
    assert after["encode_s_per_image"] == pytest.approx(0.1)
    assert after["mm_embedding_cache_hit_rate"] == pytest.approx(5 / 30)
    assert "mm_global_cache_hit_rate" not in after  # no --enable-mm-global-cache: absent, not 0
    assert "kv_usage" not in after and "cached_tokens_per_s" not in after


def test_an_idle_encoder_has_a_rate_of_zero_but_no_mean_encode_time_or_hit_rate():
    before = parse_prometheus(encoder_text(0, 0.0, 0, 0))
    after = with_rates(parse_prometheus(encoder_text(0, 0.0, 0, 0)), before, 5.0)
    assert after["encoder_images_per_s"] == 0 and after["encoder_busy"] == 0
    assert "encode_s_per_image" not in after and "mm_embedding_cache_hit_rate" not in after


def test_global_cache_hit_rate_counts_only_its_own_lookups():
    snap = parse_prometheus(encoder_text(4, 0.5, 6, 6, {"hits": 2, "misses": 4, "writes": 4, "errors": 0}))
    assert snap["mm_global_cache_hit_rate"] == pytest.approx(2 / 6)
    assert snap["mm_global_cache_writes_total"] == 4
