"""The head mapping between prefill and decode ranks of different tp, and the staging buffer's copies."""

from __future__ import annotations

import pytest
import torch

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation.base import KVLayout
from engine.disaggregation.heads import HeadShare, destinations, head_shares, rank_heads, sources
from engine.disaggregation.staging import StagingArea, pack, scatter, share_bytes


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4), (4, 1), (8, 2), (2, 8), (8, 1), (1, 8)])
def test_every_decode_rank_gets_each_of_its_heads_exactly_once(p_tp, d_tp):
    k = 4
    for d in range(d_tp):
        d0, d1 = rank_heads(k, d_tp, d)
        got = []
        for s in sources(k, p_tp, d_tp, d):
            p0 = rank_heads(k, p_tp, s.p)[0]
            got += [(p0 + s.src_head + i, d0 + s.dst_head + i) for i in range(s.n)]
        assert sorted(got) == [(h, h) for h in range(d0, d1)]


def test_every_prefill_rank_has_a_share_and_replicas_after_the_first_send_nothing():
    shares = head_shares(4, 8, 2)
    assert sorted({s.p for s in shares}) == list(range(8))
    assert [s.n for s in destinations(4, 8, 2, 1)] == [0]  # head 0's second replica
    assert destinations(4, 8, 2, 2) == [HeadShare(2, 0, 0, 1, 1)]


def test_equal_tp_pairs_rank_with_rank_whole():
    assert head_shares(4, 8, 8)[5] == HeadShare(5, 5, 0, 0, 1)
    assert head_shares(4, 2, 2) == [HeadShare(0, 0, 0, 0, 2), HeadShare(1, 1, 0, 0, 2)]


def test_a_tp_that_does_not_split_the_heads_is_refused_naming_it():
    with pytest.raises(ValueError, match="tp 3 does not split 4 KV heads"):
        head_shares(4, 3, 1)


def _pool(heads: int) -> DeviceKVPool:
    pool = DeviceKVPool(64, 4, num_layers=2, num_kv_heads=heads, head_dim=8, dtype=torch.float32)
    pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer))
    return pool


def test_packed_shares_of_two_prefill_ranks_scatter_into_one_decode_page_set():
    prefill, decode = [_pool(2), _pool(2)], _pool(4)
    src, dst = torch.tensor([1, 2, 5]), torch.tensor([3, 7, 8])
    area = StagingArea(1 << 20)
    for share in sources(4, 2, 1, 0):
        nbytes = share_bytes(KVLayout.from_pool(decode), len(src), share.n)
        at = area.alloc(nbytes)
        assert pack(prefill[share.p], area.region(at, nbytes), src, share.src_head, share.n) == nbytes
        scatter(decode, area.region(at, nbytes), dst, share.dst_head, share.n)
    for name in ("k_buffer", "v_buffer"):
        for layer in range(2):
            parts = [getattr(p, name)[layer].view(-1, 4, 2, 8)[src] for p in prefill]
            got = getattr(decode, name)[layer].view(-1, 4, 4, 8)[dst]
            assert torch.equal(got, torch.cat(parts, dim=2))


def test_the_staging_area_hands_out_first_fit_regions_and_refuses_when_full():
    area = StagingArea(100)
    assert [area.alloc(40), area.alloc(40), area.alloc(40)] == [0, 40, None]
    area.free(0)
    assert [area.alloc(30), area.alloc(20), area.alloc(1)] == [0, 80, 30]
