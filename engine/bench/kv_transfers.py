"""Bytes per token that load-back, prefetch and the PD transfer move, measured on the transfers, per KV dtype.

``python -m engine.bench.kv_transfers [--model-path smollm2] [--tokens 1024] [--page-size 64]
[--pd-backends fake mooncake]``

Each path runs the engine's own transfer code on real pools of the model's KV shape, for every
``--kv-cache-dtype`` (float32 = the CPU's compute dtype, bfloat16 = the fast mode's, fp8_e4m3, int8):

* load-back (L2 -> L1): the ``direct`` io backend's ``prepare_load`` + ``load_layer`` of every layer (what the
  cache controller runs), host pool ``layer_first`` -> device pool;
* prefetch (L3 -> L2): the ``file`` backend's ``batch_get_v1`` (the controller's prefetch read) from page
  files it wrote with ``set``, into a host pool;
* PD transfer (P's L1 -> D's L1): a prefill and a decode KV manager in this process, one room, ``send`` of
  every page until D's receiver polls Success, over the ``fake`` transport (the KV in ZMQ frames) and the
  real Mooncake ``TransferEngine`` (TCP on loopback).

"Moved" is what arrived: the destination is filled with 0x00 and then, in a second identical transfer, 0xff;
a byte counts when it differs from the fill in either run (a copied byte holds the source's value, which
cannot equal both), so the count needs no byte count of the pools. Beside it, what the code says it moved:
the file reads' bytes from ``/proc/self/io`` (``rchar``, header included) and the file backend's
``bytes_read``, and the PD transport's ``bytes_sent``. The test (tests/cache/test_transfer_bytes.py) checks
that each measured count equals the pool's ``bytes_per_token``.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.bench.kv_capacity import file_backend
from engine.cache.device_pool import DeviceKVPool
from engine.cache.host_pool import HostKVPool
from engine.cache.io_backends.direct import DirectIO
from engine.cache.keys import page_hashes

DTYPES = ("float32", "bfloat16", "fp8_e4m3", "int8")
Shape = tuple[int, int, int]  # layers, kv heads, head_dim


def device_pool(shape: Shape, kv: str, tokens: int, page_size: int) -> DeviceKVPool:
    """An L1 of ``tokens`` slots in KV dtype ``kv`` (float32/bfloat16: the compute dtype, ``auto``)."""
    compute = torch.bfloat16 if kv == "bfloat16" else torch.float32
    flag = "auto" if kv in ("float32", "bfloat16") else kv
    return DeviceKVPool(tokens, page_size, *shape, dtype=compute, kv_cache_dtype=flag)


def host_pool(pool: DeviceKVPool, tokens: int) -> HostKVPool:
    return HostKVPool(
        tokens,
        pool.page_size,
        pool.num_layers,
        pool.num_kv_heads,
        pool.row_dim,
        pool.dtype,
        "layer_first",
        False,
    )


def randomize(buf: torch.Tensor, seed: int) -> None:
    """Random bytes in every byte of the contiguous ``buf``."""
    raw = buf.view(-1).view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def landed_bytes(dst: torch.Tensor, move: Callable[[], None]) -> int:
    """Bytes of the contiguous ``dst`` that ``move`` writes: run once over all-0x00, once over all-0xff."""
    raw = dst.view(-1).view(torch.uint8)
    raw.fill_(0)
    move()
    written = raw != 0
    raw.fill_(255)
    move()
    return int((written | (raw != 255)).sum())


def read_chars() -> int:
    """Bytes this process has read through read-like syscalls (``rchar`` of ``/proc/self/io``)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def measure_load_back(shape: Shape, kv: str, tokens: int, page_size: int) -> dict:
    """L2 -> L1 of ``tokens`` tokens; ``landed`` bytes of L1 written, ``pool`` its bytes_per_token."""
    l1 = device_pool(shape, kv, tokens, page_size)
    l2 = host_pool(l1, tokens)
    randomize(l2.kv_buffer, 1)
    io = DirectIO(l1, l2)
    dev = torch.arange(page_size, page_size + tokens, dtype=torch.int64)  # past the padding page
    host = torch.arange(tokens, dtype=torch.int64)

    def move() -> None:
        plan = io.prepare_load(dev, host, None)
        for layer in range(l1.num_layers):
            io.synchronize(io.load_layer(layer, plan))

    landed = landed_bytes(l1.kv_buffer, move)
    same = torch.equal(
        l1.kv_buffer[:, :, page_size:].contiguous().view(torch.uint8), l2.kv_buffer.view(torch.uint8)
    )
    if not same:
        raise AssertionError(f"load-back ({kv}): L1 does not hold the L2 bytes")
    return {"landed": landed, "pool": l1.bytes_per_token, "tokens": tokens}


def measure_prefetch(shape: Shape, kv: str, tokens: int, page_size: int) -> dict:
    """L3 (file backend) -> L2 of ``tokens`` tokens: ``landed`` bytes of L2 written, ``file_read`` bytes the
    reads took from the files (rchar), ``counted`` the backend's ``bytes_read``, per run."""
    l1 = device_pool(shape, kv, page_size, page_size)
    src, dst = host_pool(l1, tokens), host_pool(l1, tokens)
    randomize(src.kv_buffer, 2)
    reads: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        config, backend = file_backend(l1, dst, tmp)
        keys = page_hashes(list(range(tokens)), page_size, None, config.namespace)
        for i, key in enumerate(keys):
            backend.set(key, src.get_flat_data_page(i * page_size))
        slots = torch.arange(tokens, dtype=torch.int64)
        before = backend.get_stats()["bytes_read"]

        def move() -> None:
            start = read_chars()
            if not all(backend.batch_get_v1(keys, slots)):
                raise AssertionError(f"prefetch ({kv}): a page file was not read")
            reads.append(read_chars() - start)

        landed = landed_bytes(dst.kv_buffer, move)
        counted = (backend.get_stats()["bytes_read"] - before) // 2
        backend.close()
    if not torch.equal(dst.kv_buffer.view(torch.uint8), src.kv_buffer.view(torch.uint8)):
        raise AssertionError(f"prefetch ({kv}): L2 does not hold the stored bytes")
    return {"landed": landed, "file_read": min(reads), "counted": counted, "pool": l1.bytes_per_token}


def _wait(room, what: str, timeout: float = 120.0) -> None:
    from engine.disaggregation import KVPoll

    deadline = time.monotonic() + timeout
    while (state := room.poll()) not in (KVPoll.Success, KVPoll.Failed):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} still {state.name} after {timeout} s")
        time.sleep(0.002)
    if state == KVPoll.Failed:
        raise RuntimeError(f"{what} failed: {room.failure_exception()}")


def measure_pd(shape: Shape, kv: str, tokens: int, page_size: int, backend: str) -> dict:
    """P -> D of ``tokens`` tokens through two KV managers of this process: ``landed`` bytes of D's L1
    written, ``sent`` the transport's ``bytes_sent`` (per run)."""
    from engine.disaggregation import create_kv_manager

    p_pool, d_pool = (device_pool(shape, kv, tokens, page_size) for _ in range(2))
    randomize(p_pool.kv_buffer, 3)
    p = create_kv_manager(backend, "prefill", p_pool, bootstrap_port=0)
    d = create_kv_manager(backend, "decode", d_pool)
    pages = torch.arange(1, tokens // page_size + 1, dtype=torch.int64)
    rooms = itertools.count(1)

    def move() -> None:
        room = next(rooms)
        sender = p.create_sender(room)
        sender.init(len(pages))
        receiver = d.create_receiver("127.0.0.1", p.bootstrap_port, room)
        receiver.init(pages)
        sender.send(pages, 1, {})
        _wait(receiver, f"PD room {room} ({backend}, {kv}) on D")
        _wait(sender, f"PD room {room} ({backend}, {kv}) on P")
        receiver.close()
        sender.close()

    try:
        landed = landed_bytes(d_pool.kv_buffer, move)
        sent = p.transport.bytes_sent // 2
    finally:
        d.close()
        p.close()
    got, want = (pool.kv_buffer[:, :, page_size:].contiguous().view(torch.uint8) for pool in (d_pool, p_pool))
    if not torch.equal(got, want):  # page 0 (padding) is never sent
        raise AssertionError(f"PD ({backend}, {kv}): D's pages differ from P's")
    return {"landed": landed, "sent": sent, "pool": p_pool.bytes_per_token}


def run(
    shape: Shape, tokens: int, page_size: int, pd_backends: list[str]
) -> list[tuple[str, str, float, float]]:
    """Rows ``(path, dtype, measured bytes per token, pool bytes per token)``."""
    rows = []
    for kv in DTYPES:
        lb = measure_load_back(shape, kv, tokens, page_size)
        rows.append(("load-back L2->L1", kv, lb["landed"] / tokens, lb["pool"]))
        pf = measure_prefetch(shape, kv, tokens, page_size)
        rows.append(("prefetch L3->L2 (landed)", kv, pf["landed"] / tokens, pf["pool"]))
        rows.append(("prefetch: file bytes read", kv, pf["file_read"] / tokens, pf["pool"]))
        for backend in pd_backends:
            pd = measure_pd(shape, kv, tokens, page_size, backend)
            rows.append((f"PD {backend} (landed in D)", kv, pd["landed"] / tokens, pd["pool"]))
            rows.append((f"PD {backend}: bytes_sent", kv, pd["sent"] / tokens, pd["pool"]))
    return rows


def print_table(rows: list[tuple[str, str, float, float]]) -> None:
    base = {(path, "float32"): m for path, kv, m, _ in rows if kv == "float32"}
    base16 = {(path, "bfloat16"): m for path, kv, m, _ in rows if kv == "bfloat16"}
    print("| path | kv dtype | bytes/token measured | pool bytes/token | vs float32 | vs bfloat16 |")
    print("|---|---|---:|---:|---:|---:|")
    for path, kv, measured, pool in rows:
        vs32 = base[(path, "float32")] / measured
        vs16 = base16[(path, "bfloat16")] / measured
        print(f"| {path} | {kv} | {measured:,.1f} | {pool:,} | {vs32:.2f}x | {vs16:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    from engine.model.loader import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="smollm2")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per transfer (whole pages)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--pd-backends", nargs="*", default=["fake", "mooncake"])
    args = ap.parse_args(argv)
    if args.tokens % args.page_size:
        ap.error("--tokens must be a multiple of --page-size")
    cfg = load_config(args.model_path)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    print(
        f"model {args.model_path}: {shape[0]} layers x {shape[1]} KV heads x head_dim {shape[2]}; "
        f"{args.tokens} tokens per transfer, page {args.page_size}; "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}"
    )
    start = time.perf_counter()
    print_table(run(shape, args.tokens, args.page_size, args.pd_backends))
    print(f"({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
