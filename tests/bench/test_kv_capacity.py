"""``engine.bench.kv_capacity --part policies``: every eviction policy the bench lists runs through the
what-if replay (the engine's cache code) and prints the share that replay serves."""

from __future__ import annotations

import argparse
import math
import random
import re

from engine.bench import kv_capacity
from engine.cache.eviction_names import EVICTION_POLICIES
from engine.whatif.replay import Capacities, replay_trace
from engine.whatif.trace import TraceRequest


def conversations(n: int = 80, seed: int = 3) -> list[TraceRequest]:
    rng = random.Random(seed)
    fresh = iter(range(100, 10**6))
    convs: list[list[int]] = []
    reqs = []
    for i in range(n):
        if convs and rng.random() < 0.6:
            conv = rng.choice(convs)
        else:
            conv = [0][: rng.randint(0, 1)]
            convs.append(conv)
        conv.extend(next(fresh) for _ in range(rng.randint(1, 2)))
        reqs.append(TraceRequest(float(i), 8 * len(conv), 1, tuple(conv)))
    return reqs


def test_policies_part_prints_arc_with_the_replays_share(capsys):
    # every engine policy but priority (it needs request priorities), and the offline optimum
    assert {e for e, _, _ in kv_capacity.POLICIES} == set(EVICTION_POLICIES) - {"priority"} | {"belady"}
    reqs = conversations()
    args = argparse.Namespace(
        policy_l1_tokens=64,
        policy_l2_tokens=0,
        policy_l3_tokens=0,
        no_ceiling=False,
        no_admission=True,
        evictions=["lru", "arc"],
        block_tokens=8,
        page_size=8,
    )
    kv_capacity.part_policies({"conv": reqs}, args)
    out = capsys.readouterr().out
    printed = dict(re.findall(r"(\w+)\+l2:none\+l3:none +served +([\d.]+)%", out))
    assert set(printed) == {"lru", "arc"}
    for policy, share in printed.items():
        c = replay_trace(reqs, Capacities(64), block_tokens=8, page_size=8, eviction_policy=policy)
        assert math.isclose(float(share), round(100 * c.served_l1 / c.input_tokens, 2))
