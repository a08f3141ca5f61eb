"""Belady's MIN in the what-if: hand-worked traces, and the Mooncake trace against the engine's policies."""

from __future__ import annotations

import json
import math

import pytest

from engine.whatif.__main__ import main
from engine.whatif.belady import OPTIMUM, NextUse
from engine.whatif.replay import Capacities, ReplayCache, ceiling_share, replay_trace
from engine.whatif.trace import SHARED_TRACE_DIR, TraceRequest, load_trace

# P = block = 4. Each request is one cacheable page (its id) and a one-token tail; L1 = 4 pages holds at
# most 3 such prefixes, and 2 while a miss allocates its page and tail.
CYCLE = ["A", "B", "C", "D"] * 2
IDS = {"A": 1, "B": 2, "C": 3, "D": 4}


def req(name: str, i: int, worker: str = "") -> TraceRequest:
    return TraceRequest(float(i), 5, 1, (IDS[name], 100 + i), worker)


def test_optimum_keeps_what_is_used_soonest_where_lru_thrashes():
    # LRU on a 4-cycle with room for 3 misses every time. MIN: at D it evicts C (next used last), so A and
    # B hit; at C it evicts A or B (never used again), so D hits: 3 hits of 4 tokens.
    reqs = [req(n, i) for i, n in enumerate(CYCLE)]
    lru = replay_trace(reqs, Capacities(16), block_tokens=4, page_size=4)
    best = replay_trace(reqs, Capacities(16), block_tokens=4, page_size=4, eviction_policy=OPTIMUM)
    assert [s[0] for s in lru.per_request_served] == [0] * 8
    assert [s[0] for s in best.per_request_served] == [0, 0, 0, 0, 4, 4, 0, 4]
    assert best.served_l1 == 12 <= ceiling_share(reqs, block_tokens=4, page_size=4) * best.input_tokens


def test_each_worker_s_optimum_knows_only_its_own_future():
    # Both workers see the 4-cycle, interleaved: each cache's next use counts its own requests only, so
    # each serves the single worker's 3 hits (a shared future would evict by the other worker's uses).
    reqs = [req(n, 2 * i + w, f"w{w}") for i, n in enumerate(CYCLE) for w in (0, 1)]
    c = replay_trace(reqs, Capacities(16), block_tokens=4, page_size=4, eviction_policy=OPTIMUM)
    assert c.workers == {"w0": (40, 12, 0, 0), "w1": (40, 12, 0, 0)}


def test_next_use_is_after_now_and_inf_when_never():
    future = NextUse([[7, 8], [9], [7]])
    assert (future.next_use(7), future.next_use(9), future.next_use(5)) == (2, 1, math.inf)
    future.now = 2
    assert (future.next_use(7), future.next_use(8)) == (math.inf, math.inf)


def test_the_optimum_needs_its_future_and_no_engine_policy_takes_one():
    with pytest.raises(ValueError, match="--eviction belady"):
        ReplayCache(Capacities(16), 4, eviction_policy=OPTIMUM)
    with pytest.raises(ValueError, match="--eviction belady"):
        ReplayCache(Capacities(16), 4, eviction_policy="lru", future=NextUse([]))


def test_cli_reports_the_optimum_and_splits_the_gap(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": i, "input_length": 5, "output_length": 1, "hash_ids": [IDS[n], 100 + i]}
            for i, n in enumerate(CYCLE)]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [str(trace), "--block-tokens", "4", "--page-size", "4", "--l1-tokens", "16,inf", "--optimum"]
    assert main([*argv, "--json", "--no-ttft", "--kv-bytes-per-token", "2"]) == 0
    small, unbounded = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert small["share"] == 0 and small["optimum"]["share"] == pytest.approx(12 / 40)
    assert small["lost"]["policy"] == pytest.approx(12 / 40)  # what a better policy keeps
    assert small["ceiling_share"] == pytest.approx(16 / 40)  # A, B, C, D each repeat once
    assert small["lost"]["capacity"] == pytest.approx(4 / 40)  # what no policy keeps in 4 pages
    assert unbounded["lost"] == {"capacity": pytest.approx(0), "policy": pytest.approx(0)}
    assert main([*argv[:-1], "--no-ttft", "--kv-bytes-per-token", "2"]) == 0  # without: no optimum
    assert "optimum" not in capsys.readouterr().out


@pytest.mark.skipif(not (SHARED_TRACE_DIR / "synthetic_trace.jsonl").exists(), reason="Mooncake trace absent")
def test_no_engine_policy_beats_the_optimum_on_mooncake_s_synthetic_trace():
    reqs = load_trace(SHARED_TRACE_DIR / "synthetic_trace.jsonl")
    caps = Capacities(500_000, 2_000_000)
    share = {}
    for policy in ("lru", "lfu", "arc", OPTIMUM):
        c = replay_trace(reqs, caps, page_size=64, eviction_policy=policy)
        share[policy] = (c.served_l1 + c.served_l2) / c.input_tokens
    assert share[OPTIMUM] > max(share["lru"], share["lfu"], share["arc"])
    assert share[OPTIMUM] <= ceiling_share(reqs, page_size=64)
