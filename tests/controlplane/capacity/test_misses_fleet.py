"""Fleet miss attribution on real workers behind the real router (slow): two workers with --record-trace
behind smg's round_robin, a conversation split across them by construction, then the control plane's split
of what they recorded: every count equals the known one and the per-cause counters each worker exports sum
to the same figures (the split moves tokens only inside ``not_seen_here``)."""

from __future__ import annotations

import random

import httpx
import pytest
from cp_factories import EngineWorkerFactory
from prometheus_client.parser import text_string_to_metric_families

from controlplane.capacity.misses import pool_misses
from controlplane.capacity.services import recorded_requests_ingest
from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess, worker_args

pytestmark = [pytest.mark.slow, pytest.mark.django_db]

PAGE = 16
SP = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def _counters(url: str) -> dict[str, float]:
    """The worker's ``sglang:miss_tokens_total`` by cause, and its prompt and cached token totals."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "sglang:miss_tokens_total":
                out[s.labels["cause"]] = out.get(s.labels["cause"], 0) + s.value
            elif s.name in ("sglang:prompt_tokens_total", "sglang:cached_tokens_total"):
                out[s.name] = out.get(s.name, 0) + s.value
    return out


def test_a_conversation_split_across_two_workers_is_new_then_elsewhere(tiny_model_dir):
    rng = random.Random(7)
    x = [rng.randrange(3, 250) for _ in range(200)]  # 12 whole matchable pages (192 tokens) + 8
    longer = x + [rng.randrange(3, 250) for _ in range(100)]  # 300: 18 whole pages (288) + 12
    flags = ["--model-path", str(tiny_model_dir), "--page-size", str(PAGE), "--enable-metrics",
             "--record-trace", "--disable-fused-decode"]  # fmt: skip
    with ServerProcess(flags) as a, ServerProcess(flags) as b:
        with RouterProcess(worker_args([a.url, b.url], policy="round_robin"), min_workers=2) as router:
            # round robin: x and longer land on different workers, then each again on the same one
            for prompt in (x, longer, x, longer):
                out = httpx.post(f"{router.url}/generate", json={"input_ids": prompt, "sampling_params": SP},
                                 timeout=120)  # fmt: skip
                assert out.status_code == 200, out.text
        workers = {}
        for i, server in enumerate((a, b)):
            worker = EngineWorkerFactory(name=f"rr-{i}", url=server.url, role="mixed", page_size=PAGE)
            body = httpx.get(f"{server.url}/recorded_trace", timeout=10).json()
            recorded_requests_ingest(
                worker=worker, requests=body["requests"], block_tokens=body["block_tokens"]
            )
            workers[worker.name] = (server.url, [r["input_length"] for r in body["requests"]])
        counters = {name: _counters(url) for name, (url, _) in workers.items()}
    lengths = sorted(tuple(v[1]) for v in workers.values())
    assert lengths == [(200, 200), (300, 300)], lengths  # the router alternated, as round_robin does
    first = next(n for n, (_, ls) in workers.items() if ls[0] == 200)
    second = next(n for n in workers if n != first)
    out = pool_misses(pool="regular")
    nonzero = lambda f: {c: t for c, t in f["causes"].items() if t}  # noqa: E731
    # x: 192 never computed anywhere, 8 past the last whole page; then served from L1 the second time
    assert nonzero(out["workers"][first]) == {"new": 192, "partial_page": 16}
    # longer on the other worker: x's 192 tokens the first worker computed (elsewhere), 96 new, 12 partial;
    # then served from its own L1
    assert nonzero(out["workers"][second]) == {"elsewhere": 192, "new": 96, "partial_page": 24}
    assert out["fleet"]["served_tokens"] == 192 + 288 and out["fleet"]["miss_tokens"] == 1000 - 480
    # what each worker measured and exports: the same misses, the split only inside not_seen_here
    for name, f in out["workers"].items():
        c = counters[name]
        assert f["miss_tokens"] == c["sglang:prompt_tokens_total"] - c["sglang:cached_tokens_total"]
        assert (
            f["causes"]["new"] + f["causes"]["elsewhere"] + f["causes"]["not_seen_here"] == c["not_seen_here"]
        )
        assert f["causes"]["partial_page"] == c["partial_page"]
    assert out["fleet"]["ceiling_share"] == pytest.approx((192 + 192 + 288) / 1000)
