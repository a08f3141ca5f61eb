"""PD KV transfer per request over NIXL vs Mooncake: the same KV, the same run, the same engine path.

``python -m engine.bench.pd_transfer_nixl [--quick] [--trials N]`` starts, per page size, two prefill KV
managers in child processes (one ``mooncake``, one ``nixl``; UCX over TCP on loopback with the transport's
defaults) and two decode KV managers here, all with the SmolLM2-135M-shaped L1 pool of
``engine.bench.pd_transfer`` (30 layers, 3 KV heads, head_dim 64, float32: 46,080 bytes per token), both
prefills filled from the same seed. Per case (prompt tokens, page size, D pages contiguous or scattered)
and trial, each backend moves the same pages: a room paired first (as during P's prefill), then the time
from P's ``send()`` of every page to D's ``poll()`` seeing Success. The backends alternate which goes
first per trial; trial 0 warms both up and is not counted. D's pages are checked against P's bytes.

Prints per case the median and best ms of each and the figure: median of the paired per-trial ratios
nixl / mooncake (below 1: NIXL faster), with the ratio of the best times beside it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import UTC, datetime

import torch

from engine.bench.pd_peer import PeerProcess, fill_pool, make_pool, page_bytes
from engine.bench.pd_transfer import SMOLLM2, _pages
from engine.disaggregation import KVPoll, create_kv_manager

BACKENDS = ("mooncake", "nixl")


def transfer_once(prefill: PeerProcess, decode, room: int, src: list[int], dst: list[int]) -> float:
    """Seconds from P's ``send()`` of ``src`` to D's ``poll()`` seeing Success (pages ``dst`` reserved)."""
    prefill.call("sender", room=room)
    prefill.call("init", room=room, num_pages=len(src))
    receiver = decode.create_receiver("127.0.0.1", prefill.bootstrap_port, room)
    receiver.init(torch.tensor(dst, dtype=torch.int64))
    prefill.call("wait", room=room, states=[int(KVPoll.WaitingForInput), int(KVPoll.Failed)])
    sent_at = prefill.call("send", room=room, pages=src, first_token_id=1)["sent_at"]
    while (state := receiver.poll()) not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(0.0001)  # poll as a scheduler does between steps, leaving the GIL to the receive thread
    done = time.monotonic()
    if state != KVPoll.Success:
        raise RuntimeError(f"{decode.backend} transfer failed: {receiver.failure_exception()}")
    receiver.close()
    prefill.call("wait", room=room, states=[int(KVPoll.Success), int(KVPoll.Failed)])
    prefill.call("close", room=room)
    return done - sent_at


def run_case(pairs: dict, tokens: int, page_size: int, scattered: bool, trials: int) -> dict:
    """``pairs``: backend -> (prefill peer, decode manager, P's reference pool). Per-backend seconds."""
    num = -(-tokens // page_size)
    src, dst = _pages(num, False, 0), _pages(num, scattered, 0)
    seconds: dict[str, list[float]] = {b: [] for b in BACKENDS}
    for trial in range(trials + 1):
        order = BACKENDS if trial % 2 == 0 else BACKENDS[::-1]
        for backend in order:
            prefill, decode, _ = pairs[backend]
            room = 20_000_000 + 10 * trial + 100_000 * tokens + 7 * page_size + int(scattered)
            took = transfer_once(prefill, decode, room + BACKENDS.index(backend), src, dst)
            if trial:
                seconds[backend].append(took)
    for backend in BACKENDS:
        _, decode, ref = pairs[backend]
        ends = [*range(min(4, num)), *range(max(0, num - 4), num)]
        if page_bytes(decode.pool, [dst[i] for i in ends]) != page_bytes(ref, [src[i] for i in ends]):
            raise RuntimeError(f"{backend}: D's pages do not hold P's bytes")
    m, n = seconds["mooncake"], seconds["nixl"]
    return {
        "MiB": num * page_size * pairs["nixl"][1].pool.bytes_per_token / 2**20,
        "mooncake_ms": statistics.median(m) * 1e3,
        "nixl_ms": statistics.median(n) * 1e3,
        "mooncake_best": min(m) * 1e3,
        "nixl_best": min(n) * 1e3,
        "paired": statistics.median(b / a for a, b in zip(m, n, strict=True)),
        "best_ratio": min(n) / min(m),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small case (a smoke run, not the figures)")
    parser.add_argument("--trials", type=int, default=None, help="trials per case (default 11, quick 3)")
    args = parser.parse_args(argv)
    trials = args.trials or (3 if args.quick else 11)
    cases = (
        [(256, 16, False)]
        if args.quick
        else [(512, 1, False), (2048, 16, False), (2048, 16, True), (4096, 16, False)]
    )
    pool_tokens = max(2 * t for t, _, _ in cases) + 64
    print(f"# KVFleet PD transfer, NIXL vs Mooncake, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(
        f"host: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}; torch {torch.__version__}; pool {pool_tokens} tokens, SmolLM2-135M "
        f"shape; TCP on loopback; {trials} trials"
    )
    print(
        "\n| tokens | page | D pages | MiB | mooncake ms p50 | nixl ms p50 | mooncake best | nixl best "
        "| nixl / mooncake (paired p50) | nixl / mooncake (best) |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for page_size in sorted({p for _, p, _ in cases}):
        spec = {**SMOLLM2, "size": pool_tokens - pool_tokens % page_size, "page_size": page_size}
        pairs: dict = {}
        try:
            for backend in BACKENDS:
                ref = make_pool(spec)
                fill_pool(ref, 1)
                prefill = PeerProcess(backend, "prefill", spec, seed=1, bootstrap_port=0)
                pairs[backend] = (prefill, create_kv_manager(backend, "decode", make_pool(spec)), ref)
            for tokens, ps, scattered in cases:
                if ps != page_size:
                    continue
                r = run_case(pairs, tokens, page_size, scattered, trials)
                cells = [tokens, page_size, "scattered" if scattered else "contiguous", f"{r['MiB']:.1f}"]
                cells += [f"{r[k]:.1f}" for k in ("mooncake_ms", "nixl_ms", "mooncake_best", "nixl_best")]
                cells += [f"{r['paired']:.2f}", f"{r['best_ratio']:.2f}"]
                print("| " + " | ".join(map(str, cells)) + " |", flush=True)
        finally:
            for prefill, decode, _ in pairs.values():
                decode.close()
                prefill.close()


if __name__ == "__main__":
    main()
