"""The head mapping between prefill and decode ranks of different tp, and the staging buffer's copies."""

from __future__ import annotations

import pytest
import torch

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation.base import KVLayout
from engine.disaggregation.heads import HeadShare, destinations, head_shares, rank_heads, sources
from engine.disaggregation.staging import StagingArea, pack, scatter, share_bytes, whole_share_mismatch


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
    assert head_shares(4, 8, 8)[5] == HeadShare(5, 5, 0, 0, 1, whole=True)
    assert head_shares(4, 2, 2) == [HeadShare(0, 0, 0, 0, 2, True), HeadShare(1, 1, 0, 0, 2, True)]


def test_a_share_is_whole_only_when_it_is_every_head_of_both_ranks():
    assert all(not s.whole for s in head_shares(4, 2, 1) + head_shares(4, 1, 2) + head_shares(4, 8, 2))
    # tp 8 over 4 KV heads holds one head per rank, as does tp 4: each decode rank's one head is whole
    assert destinations(4, 8, 4, 2) == [HeadShare(2, 1, 0, 0, 1, whole=True)]


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "sender_of"),
    [(1, 1, [0]), (2, 1, [0]), (1, 2, [0, 0]), (4, 2, [0, 2]), (2, 4, [0, 0, 1, 1]), (3, 2, [0, 1])],
)
def test_the_mla_latent_goes_whole_once_to_each_decode_rank_from_one_prefill_rank(p_tp, d_tp, sender_of):
    """One KV head (MLA's latent) is on every rank of both sides: never sliced, no tp divisibility rule;
    decode rank d gets it whole from prefill rank d * p_tp // d_tp, the other prefill ranks send nothing."""
    shares = head_shares(1, p_tp, d_tp)
    for d in range(d_tp):
        (got,) = [s for s in sources(1, p_tp, d_tp, d) if s.n]
        assert got == HeadShare(sender_of[d], d, 0, 0, 1, whole=True)
    for p in range(p_tp):  # every prefill rank takes part; a non-sender with one empty share
        mine = destinations(1, p_tp, d_tp, p)
        assert mine == [s for s in shares if s.p == p] and mine
        if p not in sender_of:
            assert [(s.n, s.whole) for s in mine] == [(0, False)]
    assert sum(s.n for s in shares) == d_tp  # the latent crosses once per decode rank


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


def test_a_whole_share_moves_only_between_pools_holding_exactly_its_heads():
    one, four = KVLayout.from_pool(_pool(1)), KVLayout.from_pool(_pool(4))
    latent = {"src_head": 0, "dst_head": 0, "n": 1, "whole": True}
    assert whole_share_mismatch(one, one, latent) is None
    assert "(prefill rank holds 4, decode rank 1)" in whole_share_mismatch(four, one, latent)
    assert "from head 2 to head 0" in whole_share_mismatch(four, four, {**latent, "src_head": 2, "n": 4})
