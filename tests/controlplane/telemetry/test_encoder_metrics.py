"""An EPD encoder's counters, as its /metrics renders them and a real Prometheus holds its scrapes, become
its page's figures (PromQL over the last minute): images/s, encode seconds per wall second, mean encode time
per image, and the hit rates of both embedding caches (absent, not 0, without their lookups)."""

import time

import pytest

from controlplane.telemetry import live, worker_view


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


def _scraped(tsdb, *texts: str) -> dict:
    """The encoder ``e0``'s page figures now, its scrapes ``texts`` 10 s apart ending 5 s ago."""
    now = time.time()
    tsdb.serve([("e0", now - 5 - 10 * (len(texts) - 1 - i), t) for i, t in enumerate(texts)])
    return worker_view.points(["e0"])["e0"]["figures"]


def test_encoder_counters_give_images_per_s_busy_share_and_mean_encode_time(tsdb):
    figures = _scraped(tsdb, encoder_text(10, 1.0, 0, 10), encoder_text(30, 3.0, 5, 25))
    assert figures["encoder_images_per_s"] > 0 and figures["encoder_busy"] > 0
    assert figures["encode_s_per_image"] == pytest.approx(0.1)  # 2 s of vision tower for 20 images
    assert figures["mm_embedding_cache_hit_rate"] == pytest.approx(5 / 20)  # the minute's lookups, exactly
    assert "mm_global_cache_hit_rate" not in figures  # no --enable-mm-global-cache: absent, not 0
    assert "host_pool_use" not in figures and "cached_device_per_s" not in figures


def test_an_idle_encoder_has_a_rate_of_zero_but_no_mean_encode_time_or_hit_rate(tsdb):
    figures = _scraped(tsdb, encoder_text(0, 0.0, 0, 0), encoder_text(0, 0.0, 0, 0))
    assert figures["encoder_images_per_s"] == 0 and figures["encoder_busy"] == 0
    assert "encode_s_per_image" not in figures and "mm_embedding_cache_hit_rate" not in figures


def test_global_cache_hit_rate_counts_only_its_own_lookups(tsdb):
    text = encoder_text(4, 0.5, 6, 6, {"hits": 2, "misses": 4, "writes": 4, "errors": 0})
    tsdb.serve([("e0", time.time() - 5, text)])
    figures = live.worker_figures()["e0"]  # since the encoder started, as the fleet page shows it
    assert figures["mm_global_cache_hit_rate"] == pytest.approx(2 / 6)
    assert figures["mm_embedding_cache_hit_rate"] == pytest.approx(6 / 12)
