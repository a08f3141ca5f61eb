"""Capacity API: the sizing calculator (same answers as the engine's) and the workers' reported pool sizes."""

from __future__ import annotations

import itertools
import json
import time

import pytest
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory

from controlplane.capacity.services import dp_l1_share, kv_bytes_per_token, kv_sizing
from engine.sizing.kv import shape_for
from engine.sizing.tiers import dp_rank_pool_tokens, l1_pool_tokens, size_tiers

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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_control_plane_bytes_per_token_equal_the_engines_for_each_kv_dtype(dtype):
    assert kv_bytes_per_token(num_layers=30, num_kv_heads=3, head_dim=64, dtype=dtype) == (
        shape_for(30, 3, 64, dtype).bytes_per_token
    )


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


def _scraped(tsdb, gauges: dict[str, dict[str, float]]) -> None:
    """The TSDB holds one scrape of each worker (by name) exporting these gauges (SGLang's names), now."""
    now = time.time()
    tsdb.serve(
        [(name, now, "".join(f"sglang:{k} {v}\n" for k, v in g.items())) for name, g in gauges.items()]
    )


@pytest.mark.django_db
def test_workers_endpoint_reports_what_the_tsdb_scraped_of_each_worker(api_as, tsdb):
    worker = EngineWorkerFactory(host=HostFactory(name=AGENT_HOST), page_size=16, role="mixed")
    silent = EngineWorkerFactory(page_size=1, role="decode")
    _scraped(tsdb, {worker.name: {"max_total_num_tokens": 2048, "hicache_host_total_tokens": 5136}})
    rows = {r["worker"]: r for r in api_as("viewer").get("/api/v1/capacity/workers/").json()["workers"]}
    assert (rows[worker.pk]["pool"], rows[worker.pk]["page_size"]) == ("regular", 16)
    assert (rows[worker.pk]["l1_tokens"], rows[worker.pk]["l2_tokens"]) == (2048, 5136)
    assert (rows[silent.pk]["pool"], rows[silent.pk]["l1_tokens"]) == ("decode", None)


def _row(ts: int, length: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": length, "output_length": 4, "hash_ids": ids}


@pytest.mark.django_db
def test_recorded_traffic_is_stored_per_pool_and_served_as_a_trace(api_as, tmp_path):
    from engine.whatif.trace import load_trace

    host = HostFactory(name=AGENT_HOST)
    a = EngineWorkerFactory(host=host, role="mixed")
    b = EngineWorkerFactory(host=host, role="mixed")
    d = EngineWorkerFactory(host=host, role="decode")
    agent = api_as("agent")
    for worker, rows in (
        (a, [_row(1_000_500, 600, [11, 12]), _row(1_002_000, 100, [13])]),
        (b, [_row(1_001_000, 700, [11, 14])]),
        (d, [_row(5, 10, [1])]),
    ):
        pushed = agent.post(
            "/api/v1/agent/traces/", {"worker_url": worker.url, "requests": rows}, format="json"
        )
        assert pushed.status_code == 202 and pushed.json() == {"stored": len(rows)}, pushed.content
    viewer = api_as("viewer")
    pools = {p["pool"]: p for p in viewer.get("/api/v1/capacity/traces/").json()["pools"]}
    assert (pools["regular"]["requests"], pools["regular"]["workers"]) == (3, 2)
    assert pools["decode"]["requests"] == 1
    response = viewer.get("/api/v1/capacity/traces/regular.jsonl")
    assert response.status_code == 200 and response["Content-Type"] == "application/x-ndjson"
    path = tmp_path / "regular.jsonl"
    path.write_bytes(response.content)
    trace = load_trace(path)  # the what-if's own reader accepts it
    assert [(r.timestamp, r.input_length, r.hash_ids) for r in trace] == [
        (0, 600, (11, 12)),
        (500, 700, (11, 14)),
        (1500, 100, (13,)),
    ]
    assert viewer.get("/api/v1/capacity/traces/prefill.jsonl").status_code == 404


@pytest.mark.django_db
def test_trace_ingest_rejects_bad_rows_and_other_hosts(api_as, agent_for):
    worker = EngineWorkerFactory(host=HostFactory(name=AGENT_HOST))
    bad = api_as("agent").post(
        "/api/v1/agent/traces/", {"worker_url": worker.url, "requests": [_row(0, 600, [1])]}, format="json"
    )
    assert bad.status_code == 400 and "hash_ids" in json.dumps(bad.json()["error"]["detail"])
    other = agent_for("other-host").post(
        "/api/v1/agent/traces/", {"worker_url": worker.url, "requests": [_row(0, 6, [1])]}, format="json"
    )
    assert other.status_code == 403
    viewer = api_as("viewer").post(
        "/api/v1/agent/traces/", {"worker_url": worker.url, "requests": [_row(0, 6, [1])]}, format="json"
    )
    assert viewer.status_code == 403
    assert api_as("viewer").get("/api/v1/capacity/traces/").json()["pools"] == []


@pytest.mark.django_db
def test_pool_page_size_is_what_the_pools_workers_registered_with():
    from controlplane.capacity.selectors import DEFAULT_PAGE_SIZE, pool_page_size

    assert pool_page_size(pool="regular") == pool_page_size() == DEFAULT_PAGE_SIZE == 16  # no workers
    EngineWorkerFactory(role="decode", page_size=64)
    assert pool_page_size(pool="regular") == 64  # a pool without workers: the fleet's
    for size in (32, 1, 32):
        EngineWorkerFactory(role="mixed", page_size=size)
    assert (pool_page_size(pool="regular"), pool_page_size(pool="decode")) == (32, 64)
    assert pool_page_size() == 32  # the most common over the fleet
    EngineWorkerFactory(role="prefill", page_size=8)
    EngineWorkerFactory(role="prefill", page_size=4)
    assert pool_page_size(pool="prefill") == 4  # a tie: the smaller


@pytest.mark.django_db
def test_default_l1_sweep_is_around_the_pools_reported_l1(api_as, tsdb):
    """The what-if's L1 sweep starts around the L1 pool the marked pool's first reporting worker runs (the
    chart's current-capacity line), in whole pages; another pool's when the pool has none reporting; GPU-sized
    values when no worker has reported."""
    from controlplane.capacity.selectors import FALLBACK_L1_SWEEP, l1_sweep, worker_capacities

    assert l1_sweep(pool="regular", workers=worker_capacities(), page_size=16) == {
        "l1_tokens": list(FALLBACK_L1_SWEEP),
        "source": "no worker has reported its L1 pool size yet: GPU-sized defaults",
    }
    host = HostFactory(name=AGENT_HOST)
    for name in ("demo-w0", "demo-w1"):
        EngineWorkerFactory(name=name, host=host, role="mixed", page_size=16)
    _scraped(tsdb, {"demo-w0": {"max_total_num_tokens": 1000}, "demo-w1": {"max_total_num_tokens": 4096}})
    EngineWorkerFactory(name="d0", host=host, role="decode", page_size=64)  # not reporting
    workers = worker_capacities()
    regular = l1_sweep(pool="regular", workers=workers, page_size=16)
    # the live L1 first (the live configuration is the first point), then 1,000 x 1/4..16 in pages
    assert regular["l1_tokens"] == [1000, 256, 496, 2000, 4000, 8000, 16000]
    assert regular["source"] == (
        "the live L1 pool of demo-w0 first (1,000 tokens, from its metrics), then 0.25× to 16× it"
    )
    decode = l1_sweep(pool="decode", workers=workers, page_size=64)
    assert decode["l1_tokens"] == [1000, 256, 512, 1984, 4032, 8000, 16000]  # 64-token pages
    assert decode["source"].startswith(
        "the live L1 pool of demo-w0 (no decode worker has reported one) first"
    )


@pytest.mark.django_db
def test_default_l2_l3_are_the_pools_first_reporting_workers(api_as, tsdb):
    """The what-if's L2 / L3 defaults come from the worker the L1 sweep starts from: its reported host pool,
    and inf for an attached L3 backend (no capacity reported); 0 with the reason when the pool has none."""
    from controlplane.capacity.selectors import upper_tier_defaults, worker_capacities

    assert upper_tier_defaults(pool="regular", workers=worker_capacities()) == {
        "l2_tokens": "0",
        "hicache_ratio": "",
        "l3_tokens": "0",
        "source": "no regular worker has reported yet: 0 (no tier)",
    }
    host = HostFactory(name=AGENT_HOST)
    EngineWorkerFactory(name="demo-a", host=host, role="mixed", page_size=16)  # not reporting: passed over
    EngineWorkerFactory(name="demo-w0", host=host, role="mixed", page_size=16, storage_backend="mooncake")
    _scraped(tsdb, {"demo-w0": {"max_total_num_tokens": 1000, "hicache_host_total_tokens": 2064}})
    # L2 follows each L1 point by the worker's ratio ((2,064 - one 16-token page) / 1,000 = 2.048), as the
    # engine's --hicache-ratio sizes it: no sweep point is one the engine would refuse.
    assert upper_tier_defaults(pool="regular", workers=worker_capacities()) == {
        "l2_tokens": "",
        "hicache_ratio": "2.048",
        "l3_tokens": "inf",
        "source": "demo-w0 reports 2,064 L2 tokens (--hicache-ratio 2.048 × its 1,000 L1 tokens, plus the "
        "one 16-token page the engine adds: L2 follows each L1 point) and a mooncake L3 (capacity not "
        "reported: inf)",
    }


@pytest.mark.django_db
def test_whatif_replays_at_the_traces_pools_page_size_unless_given(api_as):
    """Two identical 1,010-token prompts: the second hits the whole pages of its first 1,009 tokens, so the
    L1 tokens served tell the page size replayed (32: 992; 64, the CLI's default: 960; 16: 1,008)."""
    worker = EngineWorkerFactory(host=HostFactory(name=AGENT_HOST), role="mixed", page_size=32)
    EngineWorkerFactory(role="decode", page_size=16)
    rows = [_row(0, 1010, [1, 2]), _row(1, 1010, [1, 2])]
    stored = api_as("agent").post(
        "/api/v1/agent/traces/", {"worker_url": worker.url, "requests": rows}, format="json"
    )
    assert stored.status_code == 202, stored.content
    viewer = api_as("viewer")
    for body, page_size, served in (({}, 32, 992), ({"page_size": 64}, 64, 960)):
        body = {"trace": "pool:regular", "l1_tokens": "100000", **body}
        response = viewer.post("/api/v1/capacity/whatif/", body, format="json")
        assert response.status_code == 200, response.content
        (point,) = response.json()["points"]
        assert (response.json()["page_size"], point["l1"]["tokens_served"]) == (page_size, served)


@pytest.mark.django_db
def test_whatif_skips_or_refuses_an_l2_not_larger_than_l1(api_as):
    """The engine refuses a host pool not larger than the device pool; so does its what-if: a sweep point
    with 0 < L2 <= L1 is skipped and named, a run of only such points is a 400 naming --l2-tokens."""
    worker = EngineWorkerFactory(host=HostFactory(name=AGENT_HOST), role="mixed", page_size=16)
    rows = [_row(0, 1010, [1, 2]), _row(1, 1010, [1, 2])]
    api_as("agent").post("/api/v1/agent/traces/", {"worker_url": worker.url, "requests": rows}, format="json")
    viewer = api_as("viewer")
    body = {"trace": "pool:regular", "l1_tokens": "1024,4096", "l2_tokens": "4096"}
    response = viewer.post("/api/v1/capacity/whatif/", body, format="json")
    assert response.status_code == 200, response.content
    assert [p["l1_tokens"] for p in response.json()["points"]] == [1024]
    assert response.json()["skipped"] == ["L1 4096 / L2 4096 / L3 0: L2 must be larger than L1"]  # one line
    refused = viewer.post("/api/v1/capacity/whatif/", {**body, "l1_tokens": "4096"}, format="json")
    assert refused.status_code == 400, refused.content
    assert refused.json()["error"]["code"] == "whatif_failed"
    assert "--l2-tokens: L2 (the host pool) must be larger than L1" in refused.json()["error"]["message"]


@pytest.mark.django_db
def test_whatif_l2_following_l1_by_the_ratio_never_skips(api_as):
    """The default sweep (L2 = --hicache-ratio x each L1, as the engine sizes its host pool) has no point the
    engine would refuse, where the same L1 sweep against one fixed L2 skips the larger L1s."""
    worker = EngineWorkerFactory(host=HostFactory(name=AGENT_HOST), role="mixed", page_size=16)
    rows = [_row(0, 1010, [1, 2]), _row(1, 1010, [1, 2])]
    api_as("agent").post("/api/v1/agent/traces/", {"worker_url": worker.url, "requests": rows}, format="json")
    viewer = api_as("viewer")
    body = {"trace": "pool:regular", "l1_tokens": "1024,256,4096", "hicache_ratio": 2}
    response = viewer.post("/api/v1/capacity/whatif/", body, format="json")
    assert response.status_code == 200, response.content
    points = response.json()["points"]
    assert [(p["l1_tokens"], p["l2_tokens"]) for p in points] == [(1024, 2064), (256, 528), (4096, 8208)]
    assert response.json()["skipped"] == []
    both = viewer.post("/api/v1/capacity/whatif/", {**body, "l2_tokens": "4096"}, format="json")
    assert both.status_code == 400 and "hicache_ratio" in both.json()["error"]["detail"]


@pytest.mark.django_db
def test_sizing_bytes_per_token_is_what_the_worker_reports(api_as, fake_worker):
    """Each worker's KV bytes per token is read from its /get_model_info (the demo's SmolLM2 reports 46,080
    in float32), and null, not a guess, for a worker that does not answer."""
    live = fake_worker(kv_bytes_per_token=46_080)
    answering = EngineWorkerFactory(name="w-live", url=live.url, role="mixed")
    silent = EngineWorkerFactory(name="w-gone", role="mixed")
    rows = {r["worker"]: r for r in api_as("viewer").get("/api/v1/capacity/workers/").json()["workers"]}
    assert rows[answering.pk]["kv_bytes_per_token"] == 46_080
    assert rows[silent.pk]["kv_bytes_per_token"] is None


@pytest.mark.django_db
def test_recorded_rows_keep_the_block_size_they_were_recorded_with(api_as, tmp_path):
    """The recorder's 16-token blocks travel with the rows: ingest checks the id count against them, the
    pool's trace says them (X-Block-Tokens) and holds only rows of its newest block size."""
    worker = EngineWorkerFactory(host=HostFactory(name=AGENT_HOST), role="mixed", page_size=16)
    agent = api_as("agent")
    old = {"worker_url": worker.url, "requests": [_row(0, 600, [1, 2])]}  # an older agent: 512 per id
    assert agent.post("/api/v1/agent/traces/", old, format="json").status_code == 202
    fine = {"worker_url": worker.url, "block_tokens": 16, "requests": [_row(5, 40, [7, 8, 9])]}
    assert agent.post("/api/v1/agent/traces/", fine, format="json").status_code == 202
    wrong = {**fine, "requests": [_row(6, 40, [7, 8])]}
    refused = agent.post("/api/v1/agent/traces/", wrong, format="json")
    assert refused.status_code == 400 and "2 ids for 40 tokens: want 3" in json.dumps(refused.json())
    response = api_as("viewer").get("/api/v1/capacity/traces/regular.jsonl")
    assert response["X-Block-Tokens"] == "16"
    assert [json.loads(line)["hash_ids"] for line in response.content.splitlines()] == [[7, 8, 9]]


@pytest.mark.django_db
def test_whatif_takes_every_engine_policy_and_reports_the_ceiling(api_as):
    """Two identical prompts: the unbounded cache serves the second's 1,008 tokens of 2,020, whatever the
    policy; the admission filters are the engine's, and an unknown one is a 400 naming the field."""
    worker = EngineWorkerFactory(host=HostFactory(name=AGENT_HOST), role="mixed", page_size=16)
    rows = [_row(0, 1010, [1, 2]), _row(1, 1010, [1, 2])]
    api_as("agent").post("/api/v1/agent/traces/", {"worker_url": worker.url, "requests": rows}, format="json")
    viewer = api_as("viewer")
    body = {"trace": "pool:regular", "l1_tokens": "64,4096", "eviction": "mru", "l3_admission": "tinylfu"}
    response = viewer.post("/api/v1/capacity/whatif/", body, format="json")
    assert response.status_code == 200, response.content
    assert [p["ceiling_share"] for p in response.json()["points"]] == [pytest.approx(1008 / 2020)] * 2
    assert [p["share"] for p in response.json()["points"]] == [0, pytest.approx(1008 / 2020)]
    refused = viewer.post("/api/v1/capacity/whatif/", {**body, "l2_admission": "arc"}, format="json")
    assert refused.status_code == 400 and "l2_admission" in refused.json()["error"]["detail"]
    arc = viewer.post("/api/v1/capacity/whatif/", {**body, "eviction": "arc"}, format="json")
    assert arc.status_code == 200, arc.content  # KVFleet's own policy, accepted as the engine's flag is
    assert [p["share"] for p in arc.json()["points"]] == [0, pytest.approx(1008 / 2020)]


@pytest.mark.django_db
def test_whatif_reports_belady_s_optimum_beside_the_policy_and_splits_the_gap(api_as):
    """A 4-cycle of one-page prompts (A B C D twice, 16-token pages) in an L1 of 4 pages: LRU serves
    nothing, Belady's MIN keeps A and B for their second turn and D for its (3 of the 4 repeats), and the
    fourth repeat is what no policy keeps in 4 pages. ``optimum: false`` replays the policy alone."""
    worker = EngineWorkerFactory(host=HostFactory(name=AGENT_HOST), role="mixed", page_size=16)
    rows = [
        {"timestamp": i, "input_length": 17, "output_length": 1, "hash_ids": [n, 100 + i]}
        for i, n in enumerate([1, 2, 3, 4] * 2)
    ]
    api_as("agent").post(
        "/api/v1/agent/traces/",
        {"worker_url": worker.url, "block_tokens": 16, "requests": rows},
        format="json",
    )
    viewer = api_as("viewer")
    body = {"trace": "pool:regular", "l1_tokens": "64"}
    response = viewer.post("/api/v1/capacity/whatif/", body, format="json")
    assert response.status_code == 200, response.content
    (point,) = response.json()["points"]
    assert point["share"] == 0 and point["ceiling_share"] == pytest.approx(4 * 16 / (8 * 17))
    assert point["optimum"]["share"] == pytest.approx(3 * 16 / (8 * 17))
    assert point["optimum"]["workers"] == {worker.name: pytest.approx(3 * 16 / (8 * 17))}
    assert point["lost"] == {"capacity": pytest.approx(16 / (8 * 17)), "policy": pytest.approx(48 / (8 * 17))}
    alone = viewer.post("/api/v1/capacity/whatif/", {**body, "optimum": False}, format="json").json()
    assert alone["points"][0]["optimum"] is None and alone["points"][0]["lost"]["policy"] is None
    refused = viewer.post("/api/v1/capacity/whatif/", {**body, "optimum": "maybe"}, format="json")
    assert refused.status_code == 400 and "optimum" in refused.json()["error"]["detail"]


def test_kv_dtype_ceilings_fit_each_dtype_in_the_memory_the_pools_take_now():
    """The demo's SmolLM2 (30 layers, 3 KV heads, head dim 64) in float32: at the same bytes bfloat16 holds
    2x its L1 and L2 tokens, fp8 4x, int8 (a 2-byte scale per token and head) 46,080 / 11,880 = 3.88x, in
    whole pages; without a KV shape int8 is absent with the reason, without a host pool L2 is."""
    from controlplane.capacity.selectors import kv_dtype_ceilings

    shape = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}
    info = {"kv_bytes_per_token": 46_080, "kv_cache_dtype": "float32", "kv_shape": shape}
    rows = kv_dtype_ceilings(info=info, l1_tokens=2048, l2_tokens=4112, page_size=16)
    assert [(r["dtype"], r["current"], r["bytes_per_token"]) for r in rows] == [
        ("float32", True, 46_080),
        ("bfloat16", False, 23_040),
        ("fp8", False, 11_520),
        ("int8", False, shape_for(30, 3, 64, "int8").bytes_per_token),
    ]
    assert rows[3]["bytes_per_token"] == 11_880
    assert [(r["l1_tokens"], r["l2_tokens"]) for r in rows] == [
        (2048, 4112),
        (4096, 8224),
        (8192, 16448),
        (2048 * 46_080 // 11_880 // 16 * 16, 4112 * 46_080 // 11_880 // 16 * 16),
    ]
    assert [round(r["factor"], 2) for r in rows] == [1.0, 2.0, 4.0, 3.88]

    no_shape = kv_dtype_ceilings(
        info={**info, "kv_shape": None}, l1_tokens=2048, l2_tokens=None, page_size=16
    )
    assert no_shape[1]["l1_tokens"] == 4096 and no_shape[1]["l2_tokens"] is None
    assert no_shape[1]["absent"]["l2_tokens"] == "not reported by the worker"
    assert no_shape[3]["bytes_per_token"] is None and "KV shape" in no_shape[3]["absent"]["l1_tokens"]
    bf16 = {"kv_bytes_per_token": 23_040, "kv_cache_dtype": "bfloat16", "kv_shape": shape}
    assert [r["dtype"] for r in kv_dtype_ceilings(info=bf16, l1_tokens=64, l2_tokens=0, page_size=16)] == [
        "bfloat16",
        "fp8",
        "int8",
    ]
    assert kv_dtype_ceilings(info=bf16, l1_tokens=64, l2_tokens=0, page_size=16)[0]["absent"] == {
        "l2_tokens": "no L2 host pool"
    }
    assert kv_dtype_ceilings(info={}, l1_tokens=64, l2_tokens=0, page_size=16) == []


@pytest.mark.parametrize(("kv_heads", "tp"), [(8, 1), (8, 2), (8, 8), (8, 16), (3, 3), (1, 4)])
def test_per_rank_bytes_per_token_equal_the_engines_at_each_tp(kv_heads, tp):
    cp = kv_bytes_per_token(num_layers=30, num_kv_heads=kv_heads, head_dim=64, dtype="bfloat16", tp_size=tp)
    assert cp == shape_for(30, kv_heads, 64, "bfloat16").per_rank(tp).bytes_per_token


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize(
    "l1", [{"max_total_tokens": 4100}, {"free_gpu_memory_bytes": 60 * 10**9, "mem_fraction_static": 0.85}, {}]
)
def test_dp_rank_l1_equals_the_engines_split(dp, l1):
    for bpt, page in ((23_040, 1), (114_688, 64)):
        cp = dp_l1_share(dp_size=dp, page_size=page, bytes_per_token=bpt, **l1)["max_total_tokens"]
        engine_kwargs = {("free_gpu_bytes" if k == "free_gpu_memory_bytes" else k): v for k, v in l1.items()}
        whole = l1_pool_tokens(page, bpt, **engine_kwargs)
        assert cp == dp_rank_pool_tokens(whole, dp, page), (dp, l1, bpt, page)


@pytest.mark.django_db
def test_sizing_api_sizes_one_dp_rank_of_a_dp_attention_worker(api_as):
    """tp 2, dp 2 with DP attention: each DP rank holds all 8 KV heads (attention tp 1) and half the L1."""
    query = {"num_layers": 28, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16", "page_size": 64,
             "max_total_tokens": 65_536, "tp_size": 2}  # fmt: skip
    rank = api_as("viewer").get("/api/v1/capacity/sizing/", {**query, "dp_size": 2}).json()
    assert (rank["dp_size"], rank["kv_heads_per_rank"], rank["l1_tokens"]) == (2, 8, 32_768)
    assert rank["bytes_per_token"] == 2 * 28 * 8 * 128 * 2
    for dp, problem in ((3, "must divide tp_size 2"), (4, "must divide tp_size 2")):
        bad = api_as("viewer").get("/api/v1/capacity/sizing/", {**query, "dp_size": dp})
        assert bad.status_code == 400 and bad.json()["error"]["detail"]["dp_size"][0].startswith(problem)
    bad = api_as("viewer").get("/api/v1/capacity/sizing/", {**query, "tp_size": 4, "dp_size": 2})
    assert bad.json()["error"]["detail"]["dp_size"][0].startswith("must equal tp_size 4")


@pytest.mark.django_db
def test_sizing_api_sizes_l1_and_l2_per_rank_of_a_tp_worker(api_as):
    """8 KV heads at tp 2: each rank stores 4, half the bytes per token, so the same free GPU memory per
    device holds twice the tokens; the host's RAM is shared by the ranks' host pools."""
    query = {"num_layers": 28, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16", "page_size": 64,
             "free_gpu_memory_bytes": 80 * 10**9, "mem_fraction_static": 0.85,
             "enable_hierarchical_cache": "true", "host_memory_bytes": 2000 * GIB}  # fmt: skip
    whole = api_as("viewer").get("/api/v1/capacity/sizing/", query).json()
    rank = api_as("viewer").get("/api/v1/capacity/sizing/", {**query, "tp_size": 2}).json()
    assert (whole["per_rank"], rank["per_rank"], rank["tp_size"], rank["kv_heads_per_rank"]) == (
        False, True, 2, 4
    )  # fmt: skip
    assert rank["bytes_per_token"] == whole["bytes_per_token"] // 2 == 57_344
    assert rank["l1_tokens"] == 2 * whole["l1_tokens"]
    assert rank["host_ram_left_bytes"] == 1000 * GIB - rank["l2_bytes"]
    bad = api_as("viewer").get("/api/v1/capacity/sizing/", {**query, "tp_size": 3})
    assert bad.status_code == 400
    assert bad.json()["error"]["detail"] == {"tp_size": ["the model's 8 KV heads are not divisible by 3"]}


@pytest.mark.django_db
def test_whatif_replays_a_pools_traffic_per_worker_with_one_shared_l3(api_as):
    """The demo's page replayed its three workers' traffic as one stream through one worker's L1 and L2 and
    drew the L2 hits each worker measured as L3 hits. Now each worker has its own L1 and L2 and all share one
    L3: worker b's first copy of a prompt a saw twice (write-through backed it up to L3 on a's hit) is an L3
    hit, not an L1 one, and its 96-token prefetch passes the threshold of 32 the pool reported (the
    engine's 256 would revoke it)."""
    host = HostFactory(name=AGENT_HOST)
    a = EngineWorkerFactory(host=host, name="cal-a", role="mixed", page_size=16,
                            hicache_config={"prefetch_threshold": 32})  # fmt: skip
    b = EngineWorkerFactory(host=host, name="cal-b", role="mixed", page_size=16)
    agent = api_as("agent")
    for worker, rows in ((a, [_row(0, 100, [7]), _row(10, 100, [7])]), (b, [_row(20, 100, [7])])):
        stored = agent.post(
            "/api/v1/agent/traces/", {"worker_url": worker.url, "requests": rows}, format="json"
        )
        assert stored.status_code == 202, stored.content
    viewer = api_as("viewer")
    body = {"trace": "pool:regular", "l1_tokens": "1024", "l2_tokens": "2064", "l3_tokens": "inf"}
    for extra, threshold, l3 in (({}, 32, 96), ({"prefetch_threshold": 256}, 256, 0)):
        response = viewer.post("/api/v1/capacity/whatif/", {**body, **extra}, format="json")
        assert response.status_code == 200, response.content
        (point,) = response.json()["points"]
        assert response.json()["prefetch_threshold"] == threshold
        assert (point["l1"]["tokens_served"], point["l2"]["tokens_served"], point["l3"]["tokens_served"]) == (
            96,
            0,
            l3,
        )
        assert point["workers"]["cal-b"] == {
            "input_tokens": 100, "l1_tokens_served": 0, "l2_tokens_served": 0, "l3_tokens_served": l3
        }  # fmt: skip
