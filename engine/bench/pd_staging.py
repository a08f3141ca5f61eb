"""Heterogeneous-TP PD transfer: per-head writes against the staging buffer, for the same KV.

``python -m engine.bench.pd_staging [--quick]``: a prefill rank of tp 2 sends its 2 of 4 KV heads to a decode
of tp 1 (which holds all 4), over two real Mooncake ``TransferEngine`` instances in this process (TCP on
loopback). Pools are SmolLM2-135M-like per head (30 layers, head_dim 64, float32, page 16). For each prompt
length and trial, in the same run:

* per-head: ``batch_transfer_sync_write`` of one entry per token per K/V buffer per layer, straight between
  the pools (what a transfer without staging does);
* staging: pack the share into P's registered staging buffer, one write into D's staging buffer, scatter into
  D's pages (the copies on both sides are timed too).

Both paths' results are checked byte for byte against the prefill's heads. Prints the best time of each and
their ratio (per-head / staging: how many times faster staging is); the order of the two alternates per trial.
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import UTC, datetime

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation.base import KVLayout
from engine.disaggregation.staging import StagingArea, head_write_list, scatter, share_bytes
from engine.disaggregation.transport import MooncakeTransport, batched_write, staged_write_list

LAYERS, HEAD_DIM, PAGE = 30, 64, 16


def _side(heads: int, tokens: int, staging_mb: int) -> tuple[DeviceKVPool, MooncakeTransport]:
    pool = DeviceKVPool(
        tokens, PAGE, num_layers=LAYERS, num_kv_heads=heads, head_dim=HEAD_DIM, dtype=torch.float32
    )
    pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer))
    return pool, MooncakeTransport(
        "127.0.0.1", pool, KVLayout.from_pool(pool), None, StagingArea(staging_mb << 20)
    )


def _check(p_pool: DeviceKVPool, d_pool: DeviceKVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
    for pb, db in zip(
        (*p_pool.k_buffer, *p_pool.v_buffer), (*d_pool.k_buffer, *d_pool.v_buffer), strict=True
    ):
        want = pb.view(-1, PAGE, 2, HEAD_DIM)[src]
        got = db.view(-1, PAGE, 4, HEAD_DIM)[dst][:, :, 2:4]
        assert torch.equal(want, got), "transferred heads differ from the prefill's"


def run_case(tokens: int, trials: int) -> dict:
    pages = tokens // PAGE
    p_pool, p = _side(2, tokens + PAGE, 2 * share_bytes_mb(tokens) + 1)
    d_pool, d = _side(4, tokens + PAGE, 2 * share_bytes_mb(tokens) + 1)
    p_layout, d_layout = KVLayout.from_pool(p_pool), KVLayout.from_pool(d_pool)
    src = torch.arange(1, pages + 1, dtype=torch.int64)
    dst = torch.arange(1, pages + 1, dtype=torch.int64)
    share = {"src_head": 0, "dst_head": 2, "n": 2, "staging": 0}
    peer = d.descriptor()
    per_head, staged = [], []
    for trial in range(trials):
        for kind in ("per_head", "staged") if trial % 2 == 0 else ("staged", "per_head"):
            d_pool.kv_buffer.zero_()
            t0 = time.perf_counter()
            if kind == "per_head":
                srcs, dsts, lens = head_write_list(p_layout, d_layout, src, dst, 0, 2, 2)
                assert batched_write(p.engine, peer["session_id"], srcs, dsts, lens) == 0
                per_head.append(time.perf_counter() - t0)
            else:
                srcs, dsts, lens = staged_write_list(p_pool, p_layout, p.staging, peer, src, share)
                assert batched_write(p.engine, peer["session_id"], srcs, dsts, lens) == 0
                scatter(d_pool, d.staging.region(0, lens[0]), dst, 2, 2)
                staged.append(time.perf_counter() - t0)
            _check(p_pool, d_pool, src, dst)
    nbytes = share_bytes(p_layout, pages, 2)
    entries = 2 * LAYERS * tokens
    p.close()
    d.close()
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "entries_per_head": entries,
        "per_head_s": min(per_head),
        "staged_s": min(staged),
        "ratio": min(per_head) / min(staged),
    }


def share_bytes_mb(tokens: int) -> int:
    return -(-(2 * LAYERS * tokens * 2 * HEAD_DIM * 4) >> 20)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one prompt length, 3 trials")
    args = ap.parse_args(argv)
    lengths, trials = ([128], 2) if args.quick else ([128, 512, 1024], 3)
    print(f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} torch threads; P tp 2 -> D tp 1, 2 of 4 heads per P rank")  # fmt: skip
    print("| prompt tokens | share MB | per-head entries | per-head ms | staging ms | per-head / staging |")
    print("|---|---|---|---|---|---|")
    for tokens in lengths:
        r = run_case(tokens, trials)
        print(
            f"| {tokens} | {r['bytes'] / 2**20:.2f} | {r['entries_per_head']} | {r['per_head_s'] * 1e3:.1f} "
            f"| {r['staged_s'] * 1e3:.1f} | {r['ratio']:.2f}x |"
        )


if __name__ == "__main__":
    main()
