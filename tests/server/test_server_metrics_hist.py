"""HiCache per-operation histograms on /metrics of a real HTTP server (SGLang names and buckets): after an
eviction, an L2 load-back, an L3 backup and an L3 prefetch (file backend) each has observations."""

from __future__ import annotations

import json
import random

from prometheus_client.parser import text_string_to_metric_families
from server_testlib import wait_idle

PAGE = 16


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _series(family, **labels) -> dict[str, float]:
    """``{"count", "sum", "+Inf", <le>...}`` of the histogram series whose labels include ``labels``."""
    out = {}
    for s in family.samples:
        if any(s.labels.get(k) != v for k, v in labels.items()):
            continue
        if s.name.endswith("_bucket"):
            out[s.labels["le"]] = s.value
        else:
            out[s.name.rsplit("_", 1)[-1]] = s.value
    return out


def _counter(families: dict, name: str) -> float:
    return next(s.value for s in families[name].samples if s.name == f"{name}_total")


def test_hicache_histograms_after_load_back_backup_and_prefetch(serve, tmp_path):
    extra = json.dumps({"file_path": str(tmp_path / "l3"), "prefetch_threshold": 16})
    server, client = serve(
        "--enable-metrics", "--page-size", str(PAGE), "--max-total-tokens", "1024",
        "--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", extra, "--hicache-storage-prefetch-policy", "wait_complete",
    )  # fmt: skip
    engine = server.engine
    rng = random.Random(3)
    body = {
        "input_ids": [rng.randrange(3, 300) for _ in range(200)],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    }
    cold = client.post("/generate", json=body).json()
    wait_idle(engine)  # L1 -> L2 copy and L2 -> L3 backup done
    assert engine.scheduler.call(lambda s: s.cache.evict(10**6)).result(30) >= 192
    l2 = client.post("/generate", json=body).json()  # L2 -> L1 load-back
    assert l2["meta_info"]["cached_tokens"] == 192 and l2["output_ids"] == cold["output_ids"]
    wait_idle(engine)
    assert client.post("/flush_cache").status_code == 200  # L1/L2 cleared, L3 kept
    l3 = client.post("/generate", json=body).json()  # L3 -> L2 prefetch
    assert l3["meta_info"]["cached_tokens"] == 192 and l3["output_ids"] == cold["output_ids"]
    wait_idle(engine)

    families = _families(client.get("/metrics").text)
    for name in ("load_back_duration_seconds", "eviction_duration_seconds"):
        family = families[f"sglang:{name}"]
        assert family.type == "histogram"
        series = _series(family)
        assert series["count"] >= 1 and series["+Inf"] == series["count"] and series["sum"] > 0, name
    for name in ("backup_bandwidth", "prefetch_bandwidth", "backup_pgs", "prefetch_pgs"):
        family = families[f"sglang:{name}"]
        assert family.type == "histogram"
        series = _series(family, storage_backend="file")
        assert series["count"] >= 1 and series["+Inf"] == series["count"] and series["sum"] > 0, name
        assert all(s.labels["model_name"] for s in family.samples)
    # every page batch that reached L3 / came back from it is counted in the page histograms
    backup_pages = _series(families["sglang:backup_pgs"], storage_backend="file")["sum"]
    prefetch_pages = _series(families["sglang:prefetch_pgs"], storage_backend="file")["sum"]
    assert backup_pages * PAGE == _counter(families, "sglang:backuped_tokens")
    assert prefetch_pages * PAGE == _counter(families, "sglang:prefetched_tokens") == 192
    assert _series(families["sglang:prefetch_pgs"], storage_backend="file")["10.0"] == 0  # 12 pages: le 50
