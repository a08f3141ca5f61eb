"""TinyLFU-style admission (``engine/cache/admission.py``) and what the cache policy does with it."""

from __future__ import annotations

import pytest
from cache_testlib import check_invariants, prefill

from engine.cache.admission import FrequencySketch, page_ids, salt_seed


def test_doorkeeper_takes_the_first_sighting_and_the_sketch_the_rest():
    sketch = FrequencySketch(width=1024)
    assert sketch.estimate(42) == 0
    sketch.add(42)
    assert sketch.estimate(42) == 1 and 42 in sketch.doorkeeper
    for _ in range(3):
        sketch.add(42)
    assert sketch.estimate(42) == 4
    for _ in range(40):
        sketch.add(42)
    assert sketch.estimate(42) == 16  # 4-bit counters saturate at 15, plus the doorkeeper bit


def test_aging_halves_counts_and_clears_the_doorkeeper():
    sketch = FrequencySketch(width=16, sample=20)
    for _ in range(9):
        sketch.add(7)
    assert sketch.estimate(7) == 9
    for item in range(100, 111):  # the 20th addition ages
        sketch.add(item)
    assert sketch.estimate(7) == 4 and not sketch.doorkeeper


def test_page_ids_chain_the_prefix_and_the_salt():
    a = page_ids([1, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3
    assert page_ids([9, 9, 3, 4], 2)[1] != a[1]  # same page, other prefix
    assert page_ids([1, 2, 3, 4], 2, salt_seed("t")) != a[:2]
    assert page_ids([1, 2, 3, 4, 5], 2) == a[:2]  # a partial page has no id


def test_l2_admission_keeps_a_full_host_pool_for_the_popular_prefix(make_cache):
    """Host pool of 20 tokens (5 pages), 16 of them holding a prefix asked for three times; a one-off
    prompt's pages are not admitted while L2 is full, so the popular prefix stays in L2 (with no admission
    it would go)."""
    results = {}
    for admission in ("none", "tinylfu"):
        cache = make_cache(16, ratio=1.01, write_policy="write_through", l2_admission=admission)
        hot = list(range(1, 17))
        for _ in range(3):
            prefill(cache, hot)
        cache.drain_io()
        cache.evict(16)
        prefill(cache, list(range(100, 116)))  # one-off: wants host slots, L2 is full of hot
        cache.drain_io()
        m = cache.match_prefix(hot)
        results[admission] = m.device_indices.numel() + m.host_hit_length
        check_invariants(cache)
    assert results == {"none": 0, "tinylfu": 16}


@pytest.mark.parametrize("bad", [{"l2_admission": "arc"}, {"l3_admission": "yes"}])
def test_unknown_admission_is_refused_naming_the_key(make_cache, bad):
    key = next(iter(bad))
    with pytest.raises(ValueError, match=f"{key}: .* is not one of none, tinylfu"):
        make_cache(**bad)
