"""Miss attribution on a real worker: a request sequence whose causes are known by construction (first
sightings, a small L2 that must evict, an L1 eviction with no L2, an L3 prefetch below its threshold, an
L3 slower than recompute, partial pages, prompt log-probabilities): the per-request
``miss_tokens_details`` and the ``sglang:miss_tokens`` counters equal the known counts exactly and sum to
the measured misses. The split across workers behind the real router is
tests/controlplane/capacity/test_misses_fleet.py."""

from __future__ import annotations

import json
import random

from server_testlib import wait_idle

from engine.cache.misses import MISS_CAUSES
from engine.server.tenants import salt_label

PAGE = 16
PROMPT_LEN = 200  # 12 whole pages of matchable prompt (199 tokens -> 192), 8 tokens past them
ALIGNED = (PROMPT_LEN - 1) // PAGE * PAGE
PARTIAL = PROMPT_LEN - ALIGNED
NEW_TOKENS = 12  # prompt + output = 212 -> a 208-token node: one fits the 256-token L1 at a time
SALT = "tenant-a"


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]


def _flags(*extra: str) -> list[str]:
    return [
        "--enable-metrics", "--page-size", str(PAGE), "--max-total-tokens", "256",
        "--chunked-prefill-size", "256", *extra,
    ]  # fmt: skip


def _generate(server, client, prompt: list[int], **extra) -> dict:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        "cache_salt": SALT,
        **extra,
    }
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    wait_idle(server.engine)  # write-through copies and L3 backups acknowledged before the next request
    return resp.json()["meta_info"]


def _counters(client) -> dict[str, dict[str, float]]:
    """Every ``sglang:*miss*`` / prompt / cached counter sample as ``{name: {labels: value}}``."""
    out: dict[str, dict[str, float]] = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("sglang:") and "_total{" in line:
            name, rest = line.split("{", 1)
            labels, value = rest.rsplit("} ", 1)
            out.setdefault(name, {})[labels] = float(value)
    return out


def _by(samples: dict[str, float], label: str) -> dict[str, float]:
    """Sum ``samples`` per value of ``label``."""
    out: dict[str, float] = {}
    for labels, value in samples.items():
        for part in labels.split(","):
            key, _, v = part.partition("=")
            if key == label:
                out[v.strip('"')] = out.get(v.strip('"'), 0) + value
    return out


def _check_sums(client, metas: list[dict], expected: dict[str, int]) -> None:
    """Per request the causes sum to its misses; the counters equal ``expected`` (every other cause 0),
    the tenant's counters equal them too, and they sum to prompt tokens less cached tokens."""
    for meta in metas:
        causes = meta["miss_tokens_details"]["causes"]
        assert sum(causes.values()) == meta["prompt_tokens"] - meta["cached_tokens"], meta
    c = _counters(client)
    by_cause = _by(c["sglang:miss_tokens_total"], "cause")
    assert set(by_cause) == set(MISS_CAUSES)
    assert {k: v for k, v in by_cause.items() if v} == expected
    tenant = _by(
        {k: v for k, v in c["sglang:tenant_miss_tokens_total"].items() if salt_label(SALT) in k}, "cause"
    )
    assert {k: v for k, v in tenant.items() if v} == expected
    prompt = sum(c["sglang:prompt_tokens_total"].values())
    cached = sum(c["sglang:cached_tokens_total"].values())
    assert (
        sum(by_cause.values())
        == prompt - cached
        == sum(m["prompt_tokens"] - m["cached_tokens"] for m in metas)
    )


def test_first_sightings_and_a_small_l2_that_must_evict(serve):
    # write_through: every computed page gets an L2 copy; L2 = 1.25 x L1 = 320 tokens holds one 208-token
    # node, so b's copy must evict a from L2 (a left L1 when b was admitted).
    server, client = serve(*_flags("--enable-hierarchical-cache", "--hicache-ratio", "1.25"))
    a, b = _prompt(1), _prompt(2)
    metas = [_generate(server, client, p) for p in (a, a, b, a)]
    new = {"not_seen_here": ALIGNED, "partial_page": PARTIAL}
    assert [m["miss_tokens_details"]["causes"] for m in metas] == [
        new,
        {"partial_page": PARTIAL},
        new,
        {"evicted_host": ALIGNED, "partial_page": PARTIAL},
    ]
    assert metas[3]["miss_tokens_details"]["evicted_by"] == {"lru": ALIGNED}
    expected = {"not_seen_here": 2 * ALIGNED, "evicted_host": ALIGNED, "partial_page": 4 * PARTIAL}
    _check_sums(client, metas, expected)
    evicted = _by(_counters(client)["sglang:miss_evicted_tokens_total"], "radix_eviction_policy")
    assert evicted["lru"] == ALIGNED and sum(evicted.values()) == ALIGNED


def test_l1_eviction_without_an_l2(serve):
    """A plain L1 cache (no L2): a page b's admission evicts is gone from this worker ("evicted_device"),
    recorded with the eviction policy that chose it."""
    server, client = serve(*_flags("--radix-eviction-policy", "fifo"))
    a, b = _prompt(3), _prompt(4)
    metas = [_generate(server, client, p) for p in (a, b, a)]
    assert metas[2]["miss_tokens_details"] == {
        "causes": {"evicted_device": ALIGNED, "partial_page": PARTIAL},
        "evicted_by": {"fifo": ALIGNED},
    }
    expected = {"not_seen_here": 2 * ALIGNED, "evicted_device": ALIGNED, "partial_page": 3 * PARTIAL}
    _check_sums(client, metas, expected)


def test_l3_prefetch_below_threshold_and_prompt_logprobs(serve, tmp_path):
    # write_through with a file L3 and a prefetch threshold above any request's uncached tail: no prefetch
    # ever runs, so an evicted page that was backed up to L3 is an "L3 not used" miss.
    extra = json.dumps({"file_path": str(tmp_path / "l3"), "prefetch_threshold": 4 * PROMPT_LEN})
    server, client = serve(
        *_flags("--enable-hierarchical-cache", "--hicache-ratio", "1.25"),
        "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra,
    )  # fmt: skip
    a, b = _prompt(5), _prompt(6)
    metas = [_generate(server, client, p) for p in (a, b, a)]  # b's L2 copy evicts a (sent to L3) from L2
    # a, cached in L1 after its third run, asked for prompt log-probabilities from position 100: the pages
    # from the one holding position 100 on are computed for their logits rows
    metas.append(_generate(server, client, a, return_logprob=True, logprob_start_len=100))
    capped = 99 // PAGE * PAGE
    new = {"not_seen_here": ALIGNED, "partial_page": PARTIAL}
    assert [m["miss_tokens_details"]["causes"] for m in metas] == [
        new,
        new,
        {"l3_below_threshold": ALIGNED, "partial_page": PARTIAL},
        {"prompt_logprobs": ALIGNED - capped, "partial_page": PARTIAL},
    ]
    assert metas[3]["cached_tokens"] == capped
    _check_sums(
        client,
        metas,
        {
            "not_seen_here": 2 * ALIGNED,
            "l3_below_threshold": ALIGNED,
            "prompt_logprobs": ALIGNED - capped,
            "partial_page": 4 * PARTIAL,
        },
    )


def test_an_l3_slower_than_recompute_times_out(serve, tmp_path):
    """An L3 whose reads are slower than recomputing (a file L3 waiting ``read_delay_s`` on each read,
    ``tests/controlplane/slow_l3.py``) under the ``timeout`` prefetch policy: after a flush (L1 and L2
    emptied, L3 kept) the prefetch of a's pages is given up when its timeout (50 ms, far below the 3 s
    read) passes, and those tokens are "L3 prefetch timed out", not new."""
    extra = json.dumps(
        {
            "backend_name": "slow", "module_path": "tests.controlplane.slow_l3", "class_name": "SlowFile",
            "file_path": str(tmp_path / "l3"), "read_delay_s": 3.0, "prefetch_threshold": PAGE,
            "prefetch_timeout_base": 0.05, "prefetch_timeout_per_ki_token": 0.0,
        }
    )  # fmt: skip
    server, client = serve(
        *_flags("--enable-hierarchical-cache", "--hicache-ratio", "2"),
        "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", extra,
        "--hicache-storage-prefetch-policy", "timeout",
    )  # fmt: skip
    a = _prompt(7)
    metas = [_generate(server, client, a)]  # written through to L2, backed up to L3
    assert client.post("/flush_cache").status_code == 200
    metas.append(_generate(server, client, a))
    assert [m["miss_tokens_details"]["causes"] for m in metas] == [
        {"not_seen_here": ALIGNED, "partial_page": PARTIAL},
        {"l3_timeout": ALIGNED, "partial_page": PARTIAL},
    ]
    assert metas[1]["cached_tokens"] == 0
    _check_sums(client, metas, {"not_seen_here": ALIGNED, "l3_timeout": ALIGNED, "partial_page": 2 * PARTIAL})
