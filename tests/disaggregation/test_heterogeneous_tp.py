"""Transfer managers of different tp in one process: two prefill ranks (tp 2, two of four KV heads each)
fill one decode rank's pages (tp 1, four heads), per backend, with the staging buffer on and off; and one
prefill rank (tp 1) fills two decode ranks (tp 2) with their halves. An MLA pool (one KV head: the latent,
whose K row is its first half and V row its second) moves whole between tp sizes."""

from __future__ import annotations

import time

import pytest
import torch
from pd_testlib import D_TIMEOUTS, P_TIMEOUTS, POOL, wait_terminal

from engine.bench.pd_peer import fill_pool, make_pool
from engine.disaggregation import KVPoll, create_kv_manager, transport

SRC, DST = [1, 2, 5], [3, 7, 8]


def _managers(backend, mode: str, tp: int, heads: int, model_kv_heads: int = 4, head_dim: int = 8) -> list:
    """``tp`` managers of ``mode``, rank 0 first (a prefill's rank 0 runs the bootstrap server)."""
    mgrs = []
    for rank in range(tp):
        pool = make_pool({**POOL, "heads": heads, "head_dim": head_dim})
        fill_pool(pool, 11 + rank)
        if mode == "prefill":
            port = mgrs[0].bootstrap_port if mgrs else 0
            # this test moves KV between tp sizes, not timeouts: the shared short bootstrap timeout (4 s)
            # failed both rooms once on a loaded 2-core box before the decode's first contact
            extra_p = {**P_TIMEOUTS, "bootstrap_timeout_s": 60.0, "bootstrap_port": port}
            mgrs.append(create_kv_manager(backend, mode, pool, tp_rank=rank, tp_size=tp, **extra_p))
        else:
            mgrs.append(
                create_kv_manager(
                    backend,
                    mode,
                    pool,
                    tp_rank=rank,
                    tp_size=tp,
                    model_kv_heads=model_kv_heads,
                    **{**D_TIMEOUTS, "heartbeat_max_failure": 20},
                )  # fmt: skip
            )
    return mgrs


def _move(prefills: list, decodes: list, room: int) -> None:
    senders = [p.create_sender(room) for p in prefills]
    for sender in senders:
        sender.init(len(SRC))
    receivers = [d.create_receiver("127.0.0.1", prefills[0].bootstrap_port, room) for d in decodes]
    for receiver in receivers:
        receiver.init(torch.tensor(DST))
    deadline = time.monotonic() + 30
    while any(s.poll() < KVPoll.WaitingForInput for s in senders):
        assert time.monotonic() < deadline, [s.poll().name for s in senders]
        time.sleep(0.005)
    for sender in senders:
        sender.send(torch.tensor(SRC), first_token_id=9)
    assert [wait_terminal(r) for r in receivers] == [KVPoll.Success] * len(receivers)
    assert [wait_terminal(s) for s in senders] == [KVPoll.Success] * len(senders)
    assert all(r.first_token_id == 9 for r in receivers)
    for room_obj in (*senders, *receivers):
        room_obj.close()


def _heads(pool, pages: list[int]) -> list[torch.Tensor]:
    """Each K/V buffer's pages ``(pages, page_size, heads, head_dim)``."""
    idx = torch.tensor(pages)
    return [
        b.view(-1, pool.page_size, pool.num_kv_heads, b.shape[-1])[idx]
        for b in (*pool.k_buffer, *pool.v_buffer)
    ]


@pytest.fixture(params=[False, True], ids=["per-head", "staging"])
def staging(request, monkeypatch):
    if request.param:
        monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
        monkeypatch.setenv("SGLANG_DISAGG_STAGING_POOL_SIZE_MB", "1")
    return request.param


def test_two_prefill_ranks_fill_one_decode_rank(backend, staging):
    prefills, decodes = _managers(backend, "prefill", 2, 2), _managers(backend, "decode", 1, 4)
    try:
        _move(prefills, decodes, room=41)
        want = [
            torch.cat(parts, dim=2) for parts in zip(*(_heads(p.pool, SRC) for p in prefills), strict=True)
        ]
        assert all(torch.equal(g, w) for g, w in zip(_heads(decodes[0].pool, DST), want, strict=True))
        assert decodes[0].num_rooms() == 0 and all(p.num_rooms() == 0 for p in prefills)
    finally:
        for mgr in (*decodes, *prefills):
            mgr.close()


def test_one_prefill_rank_fills_two_decode_ranks_with_their_halves(backend, staging):
    prefills, decodes = _managers(backend, "prefill", 1, 4), _managers(backend, "decode", 2, 2)
    try:
        _move(prefills, decodes, room=42)
        for rank, decode in enumerate(decodes):
            want = [w[:, :, 2 * rank : 2 * rank + 2] for w in _heads(prefills[0].pool, SRC)]
            assert all(torch.equal(g, w) for g, w in zip(_heads(decode.pool, DST), want, strict=True))
    finally:
        for mgr in (*decodes, *prefills):
            mgr.close()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_the_mla_latent_moves_whole_once_per_decode_rank(backend, p_tp, d_tp, monkeypatch, caplog):
    """Every rank holds the whole 48-value latent (one KV head, rows of 24): each decode rank gets all of it
    from one prefill rank (rank 0 here), as whole pages (the transports' per-head paths fail the room here);
    the bytes sent are the latent once per decode rank; the staging buffer, on here, is not used (the
    launch refuses it for MLA models)."""
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_POOL_SIZE_MB", "1")

    def sliced(*args, **kwargs):
        raise AssertionError("the MLA latent was sliced by heads")

    for name in ("head_write_list", "pack", "staged_write_list"):  # every per-head path of the transports
        monkeypatch.setattr(transport, name, sliced)
    mla = {"heads": 1, "model_kv_heads": 1, "head_dim": 24}
    prefills, decodes = _managers(backend, "prefill", p_tp, **mla), _managers(backend, "decode", d_tp, **mla)
    try:
        with caplog.at_level("INFO", logger="engine.disaggregation"):
            _move(prefills, decodes, room=43)
        want = _heads(prefills[0].pool, SRC)
        assert len(prefills) == 1 or not torch.equal(_heads(prefills[1].pool, SRC)[0], want[0])
        for decode in decodes:
            assert all(torch.equal(g, w) for g, w in zip(_heads(decode.pool, DST), want, strict=True))
        latent_bytes = 2 * POOL["layers"] * len(SRC) * POOL["page_size"] * 24 * 4  # K + V rows, float32
        assert [p.transport.bytes_sent for p in prefills] == [d_tp * latent_bytes] + [0] * (p_tp - 1)
        assert "staging buffer" not in caplog.text
    finally:
        for mgr in (*decodes, *prefills):
            mgr.close()
