"""L3 backend throughput next to the raw store, measured in the same run on the same bytes.

``python -m engine.bench.storage --backend file|mooncake`` fills a real host pool (``HostKVPool``,
``page_first_direct``) with random KV pages and times, alternating rounds:

* ours: ``batch_set_v1`` / ``batch_get_v1`` of the backend (keys, existence check, header + checksum for
  ``file``, stats), in batches of ``--batch`` pages as the cache controller issues them;
* raw: the store's own calls on the same page buffers: plain ``open/write/close`` and ``readinto`` of one
  file per page (no header, checksum or rename; page buffers from the backend's own ``PageRanges`` map)
  for ``file``; the same Mooncake client's
  ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` for ``mooncake``.

Every round writes fresh keys and removes them afterwards; ours and raw run back to back in each
round. It prints one row per operation: GB/s (1e9 bytes/s of wall time, median over ``--rounds``),
ours/raw on wall time (median of the per-round ratios) and ours/raw on this process's CPU time (raw
CPU seconds / ours; insensitive to other load on a shared machine, but blind to time spent in other
processes such as the Mooncake master). Target: ours/raw >= 0.8.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable

import torch

from engine.cache.host_pool import HostKVPool
from engine.cache.keys import page_hashes
from engine.cache.storage.base import HiCacheStorage, HiCacheStorageConfig
from engine.cache.storage.file import PageRanges
from engine.cache.storage.registry import create_storage_backend
from engine.fleet.mooncake_master import MooncakeMaster

LAYOUT = "page_first_direct"


def make_pool(args) -> HostKVPool:
    pool = HostKVPool(
        args.pages * args.page_size,
        args.page_size,
        args.layers,
        args.kv_heads,
        args.head_dim,
        torch.float16,
        LAYOUT,
    )
    gen = torch.Generator().manual_seed(0)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(torch.float16))
    return pool


def storage_config(args, extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        is_mla_model=False,
        model_name="bench-model",
        page_size=args.page_size,
        kv_dtype="float16",
        layout=LAYOUT,
        extra_config=extra,
    )


def round_keys(backend: HiCacheStorage, pages: int) -> list[str]:
    """Fresh page keys (a random token prefix per round)."""
    cfg = backend.storage_config
    seed = int.from_bytes(uuid.uuid4().bytes[:3], "little")
    tokens = [seed, *range(pages * cfg.page_size - 1)]
    return page_hashes(tokens, cfg.page_size, None, cfg.namespace)


def batches(keys: list[str], pool: HostKVPool, batch: int):
    """(keys, host slot indices) per batch of ``batch`` pages; page i uses host page i."""
    P = pool.page_size
    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        yield part, torch.arange(start * P, (start + len(part)) * P)


class FileRaw:
    """Plain one-file-per-page write/read of the same page buffers (no header, checksum or rename).

    Page buffers come from the same :class:`PageRanges` map the backend uses, so neither side pays a
    per-page torch view lookup that the other does not: the ratio is the cost of the file format alone.
    """

    def __init__(self, pool: HostKVPool, directory: str) -> None:
        self.pool, self.directory = pool, directory
        self.pages = PageRanges(pool)

    def _views(self, page: int) -> list[memoryview]:
        return self.pages.views(page * self.pool.page_size)

    def write(self, keys: list[str]) -> None:
        for page, key in enumerate(keys):
            with open(os.path.join(self.directory, f"raw-{key}"), "wb") as f:
                for view in self._views(page):
                    f.write(view)

    def read(self, keys: list[str]) -> None:
        for page, key in enumerate(keys):
            with open(os.path.join(self.directory, f"raw-{key}"), "rb", buffering=0) as f:
                for view in self._views(page):
                    if f.readinto(view) != view.nbytes:
                        raise RuntimeError(f"short read of raw page {key}")

    def remove(self, keys: list[str]) -> None:
        for key in keys:
            os.remove(os.path.join(self.directory, f"raw-{key}"))


class MooncakeRaw:
    """The backend's own Mooncake client, called directly with the same multi-buffer batch calls."""

    def __init__(self, pool: HostKVPool, store, batch: int) -> None:
        self.pool, self.store, self.batch = pool, store, batch

    def _buffers(self, first_page: int, count: int):
        ptrs, sizes = [], []
        for page in range(first_page, first_page + count):
            views = self.pool.get_page_buffer_views(page * self.pool.page_size)
            ptrs.append([v.data_ptr() for v in views])
            sizes.append([v.numel() * v.element_size() for v in views])
        return ptrs, sizes

    def write(self, keys: list[str]) -> None:
        for start in range(0, len(keys), self.batch):
            part = [f"raw-{k}" for k in keys[start : start + self.batch]]
            codes = self.store.batch_put_from_multi_buffers(part, *self._buffers(start, len(part)))
            if any(c != 0 for c in codes):
                raise RuntimeError(f"raw put failed: {sorted(set(codes))}")

    def read(self, keys: list[str]) -> None:
        for start in range(0, len(keys), self.batch):
            part = [f"raw-{k}" for k in keys[start : start + self.batch]]
            codes = self.store.batch_get_into_multi_buffers(part, *self._buffers(start, len(part)))
            if any(c <= 0 for c in codes):
                raise RuntimeError(f"raw get failed: {sorted(set(codes))}")

    def remove(self, keys: list[str]) -> None:
        self.store.batch_remove([f"raw-{k}" for k in keys], True)


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: user + system, all threads)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def ours_write(backend, pool, keys, batch):
    for part, slots in batches(keys, pool, batch):
        if not all(backend.batch_set_v1(part, slots)):
            raise RuntimeError("backend write failed")


def ours_read(backend, pool, keys, batch):
    for part, slots in batches(keys, pool, batch):
        if not all(backend.batch_get_v1(part, slots)):
            raise RuntimeError("backend read failed")


def ours_remove(backend, keys, directory):
    if directory is not None:
        for key in keys:
            os.remove(os.path.join(directory, f"{key}.bin"))
    else:
        backend._store.batch_remove(keys, True)


def run(args, backend: HiCacheStorage, raw, pool: HostKVPool, directory: str | None) -> list[dict]:
    total = args.pages * pool.page_bytes
    samples = {("set", "ours"): [], ("set", "raw"): [], ("get", "ours"): [], ("get", "raw"): []}
    for index in range(args.rounds):
        keys = round_keys(backend, args.pages)
        steps = {
            ("set", "raw"): lambda k=keys: raw.write(k),
            ("set", "ours"): lambda k=keys: ours_write(backend, pool, k, args.batch),
            ("get", "raw"): lambda k=keys: raw.read(k),
            ("get", "ours"): lambda k=keys: ours_read(backend, pool, k, args.batch),
        }
        for op in ("set", "get"):  # alternate who goes first, so neither always pays the other's writeback
            for who in ("raw", "ours") if index % 2 == 0 else ("ours", "raw"):
                samples[op, who].append(timed(steps[op, who]))
        raw.remove(keys)
        ours_remove(backend, keys, directory)
    rows = []
    for op in ("set", "get"):
        ours, base = samples[op, "ours"], samples[op, "raw"]
        rows.append(
            {
                "op": op,
                "ours": total / statistics.median(w for w, _ in ours) / 1e9,
                "raw": total / statistics.median(w for w, _ in base) / 1e9,
                "ratio": statistics.median(b[0] / max(o[0], 1e-9) for o, b in zip(ours, base, strict=True)),
                "cpu_ratio": statistics.median(
                    b[1] / max(o[1], 1e-9) for o, b in zip(ours, base, strict=True)
                ),
            }
        )
    return rows


def print_table(args, rows: list[dict], page_bytes: int) -> None:
    print(
        f"backend={args.backend} pages={args.pages} page_size={args.page_size} tokens "
        f"page={page_bytes / 1e6:.2f} MB batch={args.batch} rounds={args.rounds} (median)"
    )
    print("| backend | op | bytes/round | ours GB/s | raw GB/s | ours/raw wall | ours/raw CPU time |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {args.backend} | batch_{row['op']} | {args.pages * page_bytes / 1e6:.0f} MB | "
            f"{row['ours']:.2f} | {row['raw']:.2f} | {row['ratio']:.2f} | {row['cpu_ratio']:.2f} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["file", "mooncake"], required=True)
    parser.add_argument("--pages", type=int, default=128, help="pages per round (default 128)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    parser.add_argument("--layers", type=int, default=30, help="default: SmolLM2-135M's 30 layers")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="pages per batch call (default 32)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", default=None, help="file backend directory (default: a temp dir)")
    args = parser.parse_args(argv)
    for flag in ("pages", "page_size", "layers", "kv_heads", "head_dim", "batch", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    pool = make_pool(args)
    if args.backend == "file":
        directory = tempfile.mkdtemp(prefix="kvfleet-bench-", dir=args.dir)
        try:
            backend = create_storage_backend("file", storage_config(args, {"file_path": directory}), pool)
            rows = run(args, backend, FileRaw(pool, directory), pool, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    else:
        segment = 2 * args.pages * pool.page_bytes + (64 << 20)
        with MooncakeMaster() as master:
            extra = {
                "master_server_address": master.master_address,
                "metadata_server": master.metadata_url,
                "protocol": "tcp",
                "global_segment_size": segment,
                "local_buffer_size": "16mb",
            }
            backend = create_storage_backend("mooncake", storage_config(args, extra), pool)
            try:
                rows = run(args, backend, MooncakeRaw(pool, backend._store, args.batch), pool, None)
            finally:
                backend.close()
    print_table(args, rows, pool.page_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
