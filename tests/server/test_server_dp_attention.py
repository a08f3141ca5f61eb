"""DP attention (``--tp-size 2 --dp-size 2 --enable-dp-attention``) on the tiny Llama, DeepSeek-V3 (MLA + MoE)
and Qwen3-MoE: outputs equal dp 1,
a conversation's next turn lands on the rank holding its prefix, admin work reaches every DP rank or none
(the reply names the rank that refused), and the dispatcher's rule (engine/server/dp.py)."""

from __future__ import annotations

import json
import time

import pytest
from server_testlib import model_testlib

from engine.model.runner import ModelRunner
from engine.server.dp import AFFINITY_MIN_TOKENS, BALANCE_ABS_THRESHOLD, choose_rank

KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
DP2 = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")


# ---------------------------------------------------------------- the dispatch rule (no engine)
def test_longest_cached_prefix_wins():
    assert choose_rank([0, 40], [0, 0], [5, 5]) == 1
    assert choose_rank([64, 40], [3, 0], [5, 5]) == 0


def test_a_short_match_does_not_pull_the_request():
    short = AFFINITY_MIN_TOKENS - 1
    assert choose_rank([short, 0], [1, 0], [1, 0]) == 1  # least loaded instead
    assert choose_rank([AFFINITY_MIN_TOKENS, 0], [1, 0], [1, 0]) == 0


def test_no_match_goes_to_the_least_loaded_then_fewest_dispatched_then_lowest_rank():
    assert choose_rank([0, 0, 0], [2, 1, 1], [0, 9, 3]) == 2
    assert choose_rank([0, 0], [0, 0], [1, 0]) == 1
    assert choose_rank([0, 0], [0, 0], [0, 0]) == 0


def test_equal_matches_break_ties_by_load():
    assert choose_rank([32, 32], [4, 2], [0, 0]) == 1


def test_affinity_yields_to_a_large_imbalance():
    gap = BALANCE_ABS_THRESHOLD
    assert choose_rank([100, 0], [gap, 0], [0, 0]) == 0  # at the threshold: still the cache
    assert choose_rank([100, 0], [gap + 1, 0], [0, 0]) == 1


# ---------------------------------------------------------------- a real engine at dp 2
def _generate(client, ids, n=8):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def _ranks(client):
    return client.get("/server_info").json()["internal_states"]


def _until(client, ok, timeout: float = 120.0):  # a poll deadline: a hang, not a timing, fails it
    """Poll ``internal_states`` until ``ok(states)`` (a rank publishes its snapshot after its last event);
    returns them; AssertionError with the last states otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        states = _ranks(client)
        if ok(states):
            return states
        assert time.monotonic() < deadline, states
        time.sleep(0.02)


PROMPTS = [[(7 * i + 3 * j) % 300 + 10 for j in range(40)] for i in range(4)]


@pytest.fixture(scope="module", params=["deepseek_v3_moe", "qwen3_moe"])
def moe_model(request, tmp_path_factory):
    """(folder, ModelRunner) of a tiny random DeepSeek-V3 (MLA + MoE with a shared expert) or Qwen3-MoE (GQA
    + MoE), written by transformers."""
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model_testlib().save_tiny_model(folder, request.param, seed=23)
    return folder, ModelRunner(folder, dtype="float32", device="cpu")


def _dp2_equals_dp1_and_each_conversation_returns_to_its_rank(serve, model=None):
    _, one = serve("--page-size", "4", model=model)
    expected = [_generate(one, p) for p in PROMPTS]
    server, two = serve("--page-size", "4", *DP2, model=model)
    info = two.get("/server_info").json()
    assert (info["dp_size"], info["enable_dp_attention"], len(info["internal_states"])) == (2, True, 2)
    loads = two.get("/v1/loads").json()
    assert loads["dp_rank_count"] == 2 and [r["dp_rank"] for r in loads["loads"]] == [0, 1]
    assert [_generate(two, p) for p in PROMPTS] == expected
    # idle ranks, no shared prefix: alternate
    assert [r["num_dispatched_reqs"] for r in _ranks(two)] == [2, 2]

    # two conversations: turn 1 lands on an idle rank each, turn 2 (turn 1 + answer + more) follows its cache
    a, b = [[(11 * i + 5 * j) % 290 + 20 for j in range(48)] for i in (1, 2)]
    two.post("/flush_cache")
    before = _ranks(two)
    out_a, out_b = _generate(two, a), _generate(two, b)
    turn1 = _until(two, lambda rs: all(r["cached_tokens"] >= 48 for r in rs))  # each holds one conversation
    rank_a = next(i for i in (0, 1) if turn1[i]["num_dispatched_reqs"] > before[i]["num_dispatched_reqs"])
    rank_b = 1 - rank_a
    assert turn1[rank_b]["num_dispatched_reqs"] == before[rank_b]["num_dispatched_reqs"] + 1
    for conv, out, rank in ((a, out_a, rank_a), (b, out_b, rank_b)):
        hits = [r["hit_tokens"]["device"] for r in _ranks(two)]
        # the answer's ids kept below the tokenizer's vocabulary (the tiny models' LM head is wider)
        _generate(two, conv + [t % 300 for t in out] + [9, 8, 7, 6])
        after = [r["hit_tokens"]["device"] for r in _ranks(two)]
        assert after[rank] - hits[rank] >= 48  # the whole turn-1 prompt came from that rank's L1
        assert after[1 - rank] == hits[1 - rank]  # the other rank served nothing
    return server.engine


def test_dp2_equals_dp1_and_each_conversation_returns_to_its_rank(serve):
    _dp2_equals_dp1_and_each_conversation_returns_to_its_rank(serve)


def test_dp2_of_the_mla_and_moe_models_equals_dp1_and_conversations_return(serve, moe_model):
    """The same on DeepSeek-V3 (each DP rank's pool holds the MLA latent, its own rank-0 L3 writer) and on
    Qwen3-MoE: both ranks share one runner's weights, MoE layers included."""
    engine = _dp2_equals_dp1_and_each_conversation_returns_to_its_rank(serve, moe_model)
    cfg = moe_model[1].config
    assert cfg.moe and [s.pool.num_kv_heads for s in engine.schedulers] == [cfg.kv_cache_heads] * 2
    assert cfg.mla == (cfg.kv_cache_heads == 1)  # deepseek_v3: each rank's pool holds the one latent


def _series(text: str, metric: str) -> dict[str, float]:
    """``{labels: value}`` of ``metric``'s samples in a /metrics text."""
    return {
        line.split("}")[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(f"sglang:{metric}{{")
    }


def test_metrics_carry_the_dp_rank_label(serve):
    """The scheduler gauges have one series per DP rank; ``cache_hit_rate`` is each rank's last prefill
    batch (rank 0's hit is not overwritten by rank 1's later cold prefill)."""
    _, client = serve("--enable-metrics", *DP2)
    _generate(client, PROMPTS[0])  # rank 0, cold
    _generate(client, PROMPTS[0])  # rank 0 again (its cache): a hit
    _generate(client, PROMPTS[1])  # rank 1 (fewer dispatched), cold
    model = client.get("/model_info").json()["model_path"]

    def labels(metric):
        return [f'sglang:{metric}{{dp_rank="{r}",model_name="{model}",tp_rank="{r}"' for r in (0, 1)]

    deadline = time.monotonic() + 120  # a rank publishes its gauges after the step that answered
    while True:
        text = client.get("/metrics").text
        rates = [_series(text, "cache_hit_rate").get(label) for label in labels("cache_hit_rate")]
        if rates[0] is not None and rates[0] > 0 and rates[1] == 0.0:
            break
        assert time.monotonic() < deadline, rates
        time.sleep(0.02)
    for metric in (
        "num_running_reqs",
        "num_queue_reqs",
        "max_total_num_tokens",
        "token_usage",
        "cache_hit_rate",
    ):
        assert sorted(_series(text, metric)) == labels(metric), metric


def _admin(serve, *extra):
    server, client = serve(
        "--enable-hierarchical-cache", "--admin-api-key", KEY, "--page-size", "4", *DP2, *extra
    )
    return server.engine, client


def test_attach_refused_by_one_rank_leaves_no_rank_attached_and_names_it(serve, tmp_path):
    engine, client = _admin(serve)
    body = {
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config_json": json.dumps({"file_path": str(tmp_path / "l3")}),
    }
    with engine.schedulers[1].accepted():  # rank 1 is answering a request: it refuses; rank 0 attaches first
        resp = client.put("/hicache/storage-backend", json=body, headers=AUTH)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert message.startswith("Failed to attach HiCache storage backend.\nDP rank 1 of 2: Reject attach")
    assert "not idle" in message and message.endswith("(rolled back on DP rank 0)")
    assert [s.cache.storage.name for s in engine.schedulers] == [None, None]  # rank 0 rolled back
    assert client.get("/server_info").json()["hicache_storage_backend"] is None

    ok = client.put("/hicache/storage-backend", json=body, headers=AUTH)  # both idle now: both attach
    assert ok.status_code == 200, ok.text
    assert [s.cache.storage.name for s in engine.schedulers] == ["file", "file"]
    namespaces = {s.cache.controller.namespace for s in engine.schedulers}
    assert len(namespaces) == 1  # one L3 namespace

    with engine.schedulers[0].accepted():  # detach refused by rank 0: nothing detached
        refused = client.delete("/hicache/storage-backend", headers=AUTH)
    assert refused.status_code == 400 and "DP rank 0 of 2" in refused.text
    assert "rolled back" not in refused.text  # rank 0 refused first: nothing changed
    assert [s.cache.storage.name for s in engine.schedulers] == ["file", "file"]
    with engine.schedulers[1].accepted():  # detach refused by rank 1: rank 0 re-attached
        refused = client.delete("/hicache/storage-backend", headers=AUTH)
    assert refused.status_code == 400 and "DP rank 1 of 2" in refused.text
    assert "(rolled back on DP rank 0)" in refused.text
    assert [s.cache.storage.name for s in engine.schedulers] == ["file", "file"]
    assert client.delete("/hicache/storage-backend", headers=AUTH).status_code == 200
    assert [s.cache.storage.name for s in engine.schedulers] == [None, None]


def test_config_update_refused_by_one_rank_is_rolled_back(serve):
    engine, client = _admin(serve)
    old = [s.cache.config.write_policy for s in engine.schedulers]
    new = "write_back" if old[0] != "write_back" else "write_through"
    with engine.schedulers[1].accepted():
        resp = client.put("/hicache/config", json={"hicache_write_policy": new}, headers=AUTH)
    assert resp.status_code == 400 and "DP rank 1 of 2" in resp.text, resp.text
    assert "(rolled back on DP rank 0)" in resp.text
    assert [s.cache.config.write_policy for s in engine.schedulers] == old
    assert client.put("/hicache/config", json={"hicache_write_policy": new}, headers=AUTH).status_code == 200
    assert [s.cache.config.write_policy for s in engine.schedulers] == [new, new]


@pytest.mark.parametrize("busy", [0, 1])
def test_flush_reaches_every_rank_or_none(serve, busy):
    engine, client = _admin(serve)
    for p in PROMPTS[:2]:
        _generate(client, p)
    _until(client, lambda rs: all(r["cached_tokens"] > 0 for r in rs))
    with engine.schedulers[busy].accepted():
        refused = client.post("/flush_cache")
    assert refused.status_code == 400 and f"DP rank {busy} of 2" in refused.text, refused.text
    assert all(r["cached_tokens"] > 0 for r in _ranks(client))  # no rank flushed
    assert client.post("/flush_cache").status_code == 200
    _until(client, lambda rs: [r["cached_tokens"] for r in rs] == [0, 0])  # each rank's next snapshot
