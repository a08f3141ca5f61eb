"""PD KV transfer benchmark: P -> D through the engine's transfer classes, against a baseline in the same run.

``python -m engine.bench.pd_transfer [--backend mooncake|nixl] [--quick] [--trials N]`` starts, per page
size, prefill KV managers in child processes and decode KV managers here, each with its own SmolLM2-135M-
shaped L1 pool (30 layers, 3 KV heads, head_dim 64, float32: 46,080 bytes per token), over the real
transports on loopback (Mooncake TransferEngine over TCP; NIXL's UCX over TCP with the transport's defaults).
Per case (prompt tokens, page size, D pages contiguous or scattered) and trial, the engine path is timed
the same way: the room is paired first (as during P's prefill), then the time from P's ``send()`` of every
page to D's ``poll()`` seeing Success (D notices the status from its own process). Trial 0 warms up and is
not counted; what goes first alternates between trials. D's pages are checked against P's bytes.

* ``--backend mooncake`` (default): the baseline is ``batch_transfer_sync_write`` of the same write list
  (same source and destination addresses, same batches of at most ``MAX_BATCH`` entries, same TransferEngine
  instance) timed around the calls in P's process. Prints GB/s of both (best trial each), the ratio of the
  best times (raw / engine, the figure; target >= 0.8) and the median of the paired per-trial ratios.
* ``--backend nixl``: the baseline is the Mooncake engine path; both prefills are filled from the same seed
  and move the same pages. Prints per case the median and best ms of each and the figure: median of the
  paired per-trial ratios nixl / mooncake (below 1: NIXL faster), with the ratio of the best times beside it.

On a loaded machine single trials vary by 2-4x for both paths alike, so read the ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime

import torch

from engine.bench.pd_peer import PeerProcess, fill_pool, make_pool, page_bytes
from engine.disaggregation import KVPoll, create_kv_manager

POLL_S = 0.0001  # poll as a scheduler does between steps, leaving the GIL to the receive thread
SMOLLM2 = {"layers": 30, "heads": 3, "head_dim": 64, "dtype": "float32"}
CASES = [(512, 1, False), (2048, 1, False), (2048, 16, False), (2048, 16, True), (4096, 16, False)]
QUICK_CASES = [(256, 16, False)]


def _pages(num: int, scattered: bool, offset: int) -> list[int]:
    """``num`` page indices from 1 + offset; scattered = every other page (runs of one page)."""
    step = 2 if scattered else 1
    return [1 + offset + i * step for i in range(num)]


def transfer_once(prefill: PeerProcess, decode, room: int, src: list[int], dst: list[int]) -> float:
    """Seconds from P's ``send()`` of pages ``src`` to D's ``poll()`` seeing Success (``dst`` reserved on
    D); the room is paired before the clock starts and closed on both sides after. ``RuntimeError`` when the
    transfer fails."""
    prefill.call("sender", room=room)
    prefill.call("init", room=room, num_pages=len(src))
    receiver = decode.create_receiver("127.0.0.1", prefill.bootstrap_port, room)
    receiver.init(torch.tensor(dst, dtype=torch.int64))
    prefill.call("wait", room=room, states=[int(KVPoll.WaitingForInput), int(KVPoll.Failed)])
    sent_at = prefill.call("send", room=room, pages=src, first_token_id=1)["sent_at"]
    while (state := receiver.poll()) not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(POLL_S)
    done = time.monotonic()
    if state != KVPoll.Success:
        raise RuntimeError(f"{decode.backend} transfer failed: {receiver.failure_exception()}")
    receiver.close()
    prefill.call("wait", room=room, states=[int(KVPoll.Success), int(KVPoll.Failed)])
    prefill.call("close", room=room)
    return done - sent_at


def paired_seconds(paths: dict[str, Callable[[int], float]], trials: int) -> dict[str, list[float]]:
    """Seconds per trial of each of ``paths`` (name -> one timed run, given the trial number), ``trials``
    counted after one warm-up; the first path goes first in even trials, last in odd ones."""
    names = list(paths)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for trial in range(trials + 1):
        for name in names if trial % 2 == 0 else names[::-1]:
            took = paths[name](trial)
            if trial:
                seconds[name].append(took)
    return seconds


def check_pages(decode, ref, src: list[int], dst: list[int], label: str) -> None:
    """``RuntimeError`` unless D's first and last four pages ``dst`` hold ``ref``'s (P's) pages ``src``."""
    num = len(src)
    ends = [*range(min(4, num)), *range(max(0, num - 4), num)]
    if page_bytes(decode.pool, [dst[i] for i in ends]) != page_bytes(ref, [src[i] for i in ends]):
        raise RuntimeError(f"{label}: D's pages do not hold P's bytes")


def mooncake_vs_raw(pair: tuple, tokens: int, page_size: int, scattered: bool, trials: int) -> list:
    """One row of the ``--backend mooncake`` table: the engine path against a raw TransferEngine write."""
    prefill, decode, ref = pair
    num = -(-tokens // page_size)
    src, dst = _pages(num, False, 0), _pages(num, scattered, 0)
    raw_req = {
        "session_id": decode.transport.session_id,
        "layout": decode.layout.to_wire(),
        "src": src,
        "dst": dst,
    }
    room0 = 10_000_000 + 1000 * tokens + 7 * page_size + int(scattered)
    s = paired_seconds(
        {
            "engine": lambda trial: transfer_once(prefill, decode, room0 + trial, src, dst),
            "raw": lambda trial: prefill.call("raw", **raw_req)["seconds"],
        },
        trials,
    )
    check_pages(decode, ref, src, dst, "mooncake")
    engine_s, raw_s = s["engine"], s["raw"]
    nbytes = num * page_size * decode.pool.bytes_per_token
    cells = [tokens, page_size, "scattered" if scattered else "contiguous", f"{nbytes / 2**20:.1f}"]
    cells += [2 * SMOLLM2["layers"] * (num if scattered else 1)]
    cells += [f"{nbytes / min(engine_s) / 1e9:.2f}", f"{nbytes / min(raw_s) / 1e9:.2f}"]
    cells += [f"{statistics.median(engine_s) * 1e3:.1f}", f"{statistics.median(raw_s) * 1e3:.1f}"]
    cells += [f"{min(raw_s) / min(engine_s):.2f}"]
    return cells + [f"{statistics.median(r / e for r, e in zip(raw_s, engine_s, strict=True)):.2f}"]


def nixl_vs_mooncake(pairs: dict, tokens: int, page_size: int, scattered: bool, trials: int) -> list:
    """One row of the ``--backend nixl`` table: the engine path of each backend on the same pages."""
    num = -(-tokens // page_size)
    src, dst = _pages(num, False, 0), _pages(num, scattered, 0)
    room0 = 20_000_000 + 100_000 * tokens + 7 * page_size + int(scattered)

    def path(index: int, backend: str) -> Callable[[int], float]:
        prefill, decode, _ = pairs[backend]
        return lambda trial: transfer_once(prefill, decode, room0 + 10 * trial + index, src, dst)

    s = paired_seconds({b: path(i, b) for i, b in enumerate(pairs)}, trials)
    for backend, (_, decode, ref) in pairs.items():
        check_pages(decode, ref, src, dst, backend)
    m, n = s["mooncake"], s["nixl"]
    cells = [tokens, page_size, "scattered" if scattered else "contiguous"]
    cells += [f"{num * page_size * pairs['nixl'][1].pool.bytes_per_token / 2**20:.1f}"]
    cells += [f"{x:.1f}" for x in (statistics.median(m) * 1e3, statistics.median(n) * 1e3)]
    cells += [f"{min(m) * 1e3:.1f}", f"{min(n) * 1e3:.1f}"]
    return cells + [
        f"{statistics.median(b / a for a, b in zip(m, n, strict=True)):.2f}",
        f"{min(n) / min(m):.2f}",
    ]


HEADERS = {
    "mooncake": "| tokens | page_size | D pages | MiB | writes | engine GB/s | raw TE GB/s | engine ms (p50) "
    "| raw ms (p50) | ratio raw/engine (best) | paired ratio p50 |\n"
    "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    "nixl": "| tokens | page | D pages | MiB | mooncake ms p50 | nixl ms p50 | mooncake best | nixl best "
    "| nixl / mooncake (paired p50) | nixl / mooncake (best) |\n"
    "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        choices=("mooncake", "nixl"),
        default="mooncake",
        help="mooncake: against a raw TransferEngine write; nixl: against the Mooncake engine path",
    )
    parser.add_argument("--quick", action="store_true", help="one small case (a smoke run, not the figures)")
    parser.add_argument(
        "--trials",
        type=int,
        default=None,
        help="trials per case (default 15 mooncake / 11 nixl, quick 4 / 3)",
    )
    args = parser.parse_args(argv)
    nixl = args.backend == "nixl"
    trials = args.trials or ((3 if nixl else 4) if args.quick else (11 if nixl else 15))
    cases = QUICK_CASES if args.quick else CASES
    backends = ("mooncake", "nixl") if nixl else ("mooncake",)
    row = nixl_vs_mooncake if nixl else mooncake_vs_raw
    pool_tokens = max(2 * t for t, _, _ in cases) + 64
    print(f"# KVFleet PD transfer benchmark, {args.backend}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(
        f"host: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"load {os.getloadavg()[0]:.1f}; torch {torch.__version__}; pool {pool_tokens} tokens, SmolLM2-135M "
        f"shape; backends {', '.join(backends)} on loopback; {trials} trials"
    )
    print("\n" + HEADERS[args.backend])
    for page_size in sorted({p for _, p, _ in cases}):
        spec = {**SMOLLM2, "size": pool_tokens - pool_tokens % page_size, "page_size": page_size}
        pairs: dict = {}
        try:
            for backend in backends:
                ref = make_pool(spec)
                fill_pool(ref, 1)  # P's content
                prefill = PeerProcess(backend, "prefill", spec, seed=1, bootstrap_port=0)
                pairs[backend] = (prefill, create_kv_manager(backend, "decode", make_pool(spec)), ref)
            for tokens, ps, scattered in cases:
                if ps == page_size:
                    cells = row(pairs if nixl else pairs["mooncake"], tokens, page_size, scattered, trials)
                    print("| " + " | ".join(map(str, cells)) + " |", flush=True)
        finally:
            for prefill, decode, _ in pairs.values():
                decode.close()
                prefill.close()


if __name__ == "__main__":
    main()
