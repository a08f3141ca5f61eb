"""Capacity API: the sizing calculator (same answers as the engine's) and the workers' reported pool sizes."""

from __future__ import annotations

import itertools

import pytest
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory

from controlplane.capacity.services import kv_sizing
from engine.sizing.tiers import size_tiers

GIB = 1 << 30


def test_control_plane_sizing_equals_the_engine_sizing():
    grid = itertools.product(
        (23_040, 114_688),  # bytes per token
        (1, 16, 64),  # page size
        (
            {"max_total_tokens": 4096},
            {"max_total_tokens": 4100},
            {"free_gpu_memory_bytes": 60 * 10**9},
            {"free_gpu_memory_bytes": 60 * 10**9, "mem_fraction_static": 0.95},
            {},
        ),  # fmt: skip
        (
            {},
            {"enable_hierarchical_cache": True},
            {"enable_hierarchical_cache": True, "hicache_ratio": 0.5},
            {"enable_hierarchical_cache": True, "hicache_size": 30, "host_memory_bytes": 24 * GIB},
        ),  # fmt: skip
        (0, 10**9, 10**13),  # L3 bytes
    )
    for bpt, page, l1, l2, l3 in grid:
        cp = kv_sizing(bytes_per_token=bpt, page_size=page, l3_bytes=l3, **l1, **l2)
        engine_kwargs = {**l1, **l2}
        if "free_gpu_memory_bytes" in engine_kwargs:
            engine_kwargs["free_gpu_bytes"] = engine_kwargs.pop("free_gpu_memory_bytes")
        if "host_memory_bytes" in engine_kwargs:
            engine_kwargs["host_available_bytes"] = engine_kwargs.pop("host_memory_bytes")
        assert cp == size_tiers(bpt, page, l3_bytes=l3, **engine_kwargs).as_dict(), (bpt, page, l1, l2, l3)


@pytest.mark.django_db
def test_sizing_api_from_a_model_shape(api_as):
    query = {"num_layers": 28, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16", "page_size": 64,
             "free_gpu_memory_bytes": 80 * 10**9, "mem_fraction_static": 0.85,
             "enable_hierarchical_cache": "true", "host_memory_bytes": 2000 * GIB}  # fmt: skip
    body = api_as("viewer").get("/api/v1/capacity/sizing/", query).json()
    assert body["bytes_per_token"] == 114_688
    assert (body["l1_tokens"], body["l2_tokens"]) == (592_896, 2 * 592_896 + 64)
    assert body["warnings"] == []


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"bytes_per_token": 100, "page_size": 0}, "page_size"),
        ({"num_layers": 2}, "num_kv_heads"),
        ({"bytes_per_token": 100, "dtype": "int3"}, "dtype"),
        ({"bytes_per_token": 100, "mem_fraction_static": 2}, "mem_fraction_static"),
    ],
)
def test_sizing_api_names_the_bad_parameter(api_as, query, field):
    response = api_as("viewer").get("/api/v1/capacity/sizing/", query)
    assert response.status_code == 400
    assert field in response.json()["error"]["detail"]


@pytest.mark.django_db
def test_workers_endpoint_reports_what_each_worker_pushed(api_as):
    worker = EngineWorkerFactory(host=HostFactory(name=AGENT_HOST), page_size=16, role="mixed")
    silent = EngineWorkerFactory(page_size=1, role="decode")
    metrics = {"max_total_num_tokens": 2048, "hicache_host_total_tokens": 5136}
    pushed = api_as("agent").post(
        "/api/v1/agent/metrics/", {"worker": worker.pk, "metrics": metrics}, format="json"
    )
    assert pushed.status_code == 202, pushed.content
    rows = {r["worker"]: r for r in api_as("viewer").get("/api/v1/capacity/workers/").json()["workers"]}
    assert (rows[worker.pk]["pool"], rows[worker.pk]["page_size"]) == ("regular", 16)
    assert (rows[worker.pk]["l1_tokens"], rows[worker.pk]["l2_tokens"]) == (2048, 5136)
    assert (rows[silent.pk]["pool"], rows[silent.pk]["l1_tokens"]) == ("decode", None)
