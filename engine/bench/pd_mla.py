"""Bytes per token the PD transfer moves for an MLA model against a GQA model of the same hidden size, at
equal and different prefill / decode tp sizes, counted by the transports.

``python -m engine.bench.pd_mla [--layers 61] [--kv-lora-rank 512] [--rope-dim 64] [--gqa-kv-heads 8]
[--gqa-head-dim 128] [--tokens 256] [--page-size 64] [--reps 3] [--backend mooncake]``

The defaults are DeepSeek-V3's shape (hidden 7168, 61 layers, a 512 + 64 latent) and a GQA model of the
same hidden size (56 query heads x 128 = 7168, 8 KV heads of 128, as Llama-3-70B's 8 of 64), bfloat16 KV.
For each tp pair, ``p_tp`` prefill and ``d_tp`` decode KV managers run in this process (the real Mooncake
``TransferEngine`` over TCP on loopback, or NIXL / fake), each rank with its own pool of the rank's KV
(MLA: the whole latent on every rank; GQA: its ``kv_heads / tp`` heads); one room moves ``--tokens``
tokens, and "bytes per token" is the sum of the prefill ranks' ``transport.bytes_sent`` over the tokens.
Every decode rank's pages are checked against the prefill rank it received from. With ``--sliced`` the MLA
latent is also moved as the head-sliced share it was before it was made explicit (one entry per token and
buffer), for the time of one room against the whole-page path in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import time
from dataclasses import replace

import torch

from engine.bench.kv_transfers import _wait, randomize
from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation import KVPoll, create_kv_manager, heads

TP_PAIRS = ((1, 1), (2, 1), (1, 2), (2, 2))
_rooms = itertools.count(1)


def _pool(tokens: int, page_size: int, layers: int, kv_heads: int, head_dim: int, seed: int) -> DeviceKVPool:
    pool = DeviceKVPool(tokens, page_size, layers, kv_heads, head_dim, dtype=torch.bfloat16)
    randomize(pool.kv_buffer, seed)
    return pool


def measure(
    backend: str,
    p_tp: int,
    d_tp: int,
    model_kv_heads: int,
    head_dim: int,
    layers: int,
    tokens: int,
    page_size: int,
    reps: int,
) -> dict:
    """One tp pair: ``bytes`` (sum of the prefill ranks' ``bytes_sent`` per room), ``seconds`` (median time
    of a room, send to the last decode rank's Success), ``pool`` (one rank's pool bytes per token)."""
    per_rank = model_kv_heads if model_kv_heads == 1 else model_kv_heads // p_tp
    prefills = []
    for rank in range(p_tp):
        port = prefills[0].bootstrap_port if prefills else 0
        pool = _pool(tokens, page_size, layers, per_rank, head_dim, 10 + rank)
        prefills.append(
            create_kv_manager(backend, "prefill", pool, bootstrap_port=port, tp_rank=rank, tp_size=p_tp)
        )
    d_heads = model_kv_heads if model_kv_heads == 1 else model_kv_heads // d_tp
    decodes = [
        create_kv_manager(
            backend,
            "decode",
            _pool(tokens, page_size, layers, d_heads, head_dim, 50 + rank),
            tp_rank=rank,
            tp_size=d_tp,
            model_kv_heads=model_kv_heads,
        )
        for rank in range(d_tp)
    ]
    pages = torch.arange(1, tokens // page_size + 1, dtype=torch.int64)
    times = []
    try:
        for _ in range(reps + 1):  # the first room pays first contact and connection set-up: not timed
            before = sum(p.transport.bytes_sent for p in prefills)
            room = next(_rooms)
            senders = [p.create_sender(room) for p in prefills]
            for sender in senders:
                sender.init(len(pages))
            receivers = [d.create_receiver("127.0.0.1", prefills[0].bootstrap_port, room) for d in decodes]
            for receiver in receivers:
                receiver.init(pages)
            deadline = time.monotonic() + 60
            while any(s.poll() < KVPoll.WaitingForInput for s in senders):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"room {room}: prefill ranks not paired after 60 s")
                time.sleep(0.001)
            start = time.perf_counter()
            for sender in senders:
                sender.send(pages, 1, {})
            for i, receiver in enumerate(receivers):
                _wait(receiver, f"room {room} on decode rank {i}")
            times.append(time.perf_counter() - start)
            for i, sender in enumerate(senders):
                _wait(sender, f"room {room} on prefill rank {i}")
            for r in (*receivers, *senders):
                r.close()
            sent = sum(p.transport.bytes_sent for p in prefills) - before
        _check(prefills, decodes, model_kv_heads, pages)
    finally:
        for mgr in (*decodes, *prefills):
            mgr.close()
    return {"bytes": sent, "seconds": statistics.median(times[1:]), "pool": decodes[0].pool.bytes_per_token}


def _check(prefills: list, decodes: list, model_kv_heads: int, pages: torch.Tensor) -> None:
    """Each decode rank's pages hold the KV heads it received, bit for bit (random bits: NaNs compared as
    integers)."""
    p_tp, d_tp = len(prefills), len(decodes)
    for d, decode in enumerate(decodes):
        dpool = decode.pool
        for share in heads.sources(model_kv_heads, p_tp, d_tp, d):
            if not share.n:
                continue
            ppool = prefills[share.p].pool
            dbufs, pbufs = (*dpool.k_buffer, *dpool.v_buffer), (*ppool.k_buffer, *ppool.v_buffer)
            for dbuf, pbuf in zip(dbufs, pbufs, strict=True):
                got = _paged(dpool, dbuf)[pages, :, share.dst_head : share.dst_head + share.n]
                want = _paged(ppool, pbuf)[pages, :, share.src_head : share.src_head + share.n]
                if not torch.equal(got, want):
                    raise AssertionError(f"decode rank {d}: heads from prefill rank {share.p} differ")


def _paged(pool: DeviceKVPool, buf: torch.Tensor) -> torch.Tensor:
    """``buf`` as int16 ``(pages, page_size, heads, row)``."""
    return buf.view(torch.int16).view(-1, pool.page_size, pool.num_kv_heads, buf.shape[-1])


def _sliced_latent() -> None:
    """Make the latent's shares head-sliced (``whole`` off), as before the MLA case was explicit."""
    plain = heads.latent_shares

    def sliced(p_tp: int, d_tp: int) -> list[heads.HeadShare]:
        return [replace(s, whole=False) for s in plain(p_tp, d_tp)]

    heads.latent_shares = sliced  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.pd_mla", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--kv-lora-rank", type=int, default=512)
    ap.add_argument("--rope-dim", type=int, default=64)
    ap.add_argument("--gqa-kv-heads", type=int, default=8)
    ap.add_argument("--gqa-head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per room (whole pages)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="timed rooms per tp pair (after one untimed)")
    ap.add_argument("--backend", default="mooncake", choices=("mooncake", "nixl", "fake"))
    ap.add_argument("--sliced", action="store_true", help="also time the latent moved head-sliced")
    args = ap.parse_args(argv)
    if args.tokens % args.page_size:
        ap.error("--tokens must be a multiple of --page-size")
    latent = args.kv_lora_rank + args.rope_dim
    if latent % 2:
        ap.error("--kv-lora-rank + --rope-dim must be even (the latent's K and V rows are its halves)")
    common = (args.layers, args.tokens, args.page_size, args.reps)
    print(
        f"{args.backend}, bfloat16 KV, {args.layers} layers; MLA latent {args.kv_lora_rank} + "
        f"{args.rope_dim}; GQA {args.gqa_kv_heads} KV heads x {args.gqa_head_dim}; {args.tokens} tokens "
        f"per room, page {args.page_size}; median of {args.reps} rooms; "
        f"{platform.processor() or platform.machine()}"
    )
    print("| P tp -> D tp | MLA bytes/token | GQA bytes/token | GQA / MLA | MLA room ms | GQA room ms |")
    print("|---|---:|---:|---:|---:|---:|")
    start = time.perf_counter()
    for p_tp, d_tp in TP_PAIRS:
        mla = measure(args.backend, p_tp, d_tp, 1, latent // 2, *common)
        gqa = measure(args.backend, p_tp, d_tp, args.gqa_kv_heads, args.gqa_head_dim, *common)
        m, g = mla["bytes"] / args.tokens, gqa["bytes"] / args.tokens
        print(
            f"| {p_tp} -> {d_tp} | {m:,.0f} | {g:,.0f} | {g / m:.2f}x | "
            f"{mla['seconds'] * 1e3:.1f} | {gqa['seconds'] * 1e3:.1f} |"
        )
    if args.sliced:
        whole = {pair: measure(args.backend, *pair, 1, latent // 2, *common) for pair in ((2, 1), (1, 2))}
        _sliced_latent()
        print("\n| MLA P tp -> D tp | whole pages ms | head-sliced ms | sliced / whole | bytes/token |")
        print("|---|---:|---:|---:|---:|")
        for pair, w in whole.items():
            s = measure(args.backend, *pair, 1, latent // 2, *common)
            assert s["bytes"] == w["bytes"], (s["bytes"], w["bytes"])
            print(
                f"| {pair[0]} -> {pair[1]} | {w['seconds'] * 1e3:.1f} | {s['seconds'] * 1e3:.1f} | "
                f"{s['seconds'] / w['seconds']:.2f}x | {w['bytes'] / args.tokens:,.0f} |"
            )
    print(f"({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
