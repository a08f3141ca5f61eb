"""L3 backend throughput next to the raw store, measured in the same run on the same bytes.

``python -m engine.bench.storage --backend file|mooncake|nixl|aibrix|lmcache`` fills a real host pool
(``HostKVPool``, ``page_first_direct``) with random KV pages and times, alternating rounds:

* ours: ``batch_set_v1`` / ``batch_get_v1`` of the backend (keys, existence check, header + checksum for
  ``file`` and ``nixl``, stats), in batches of ``--batch`` pages as the cache controller issues them;
* raw: the store's own calls on the same page buffers: plain ``open/write/close`` and ``readinto`` of one
  file per page (no header, checksum or rename; page buffers from the backend's own ``PageRanges`` map)
  for ``file``; the same Mooncake client's
  ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` for ``mooncake``; for ``nixl`` the
  backend's own NIXL agent moving the same page buffers into one file per page (one NIXL transfer per
  batch, no header, checksum or rename); for ``aibrix`` (AIBrix KVCache's ROCKSDB store under the directory)
  the backend's own AIBrix manager storing the same page bytes under other keys (``allocate_for``, one
  copy into each block, ``put``; ``acquire`` and one copy out; no header or checksum); for ``lmcache`` (a
  real ``lmcache_server`` started from LMCache's venv, scripts/lmcache_env.sh, or the one ``--lmcache-url``
  names) the backend's own
  connections moving the same page buffers as plain objects under other keys (pipelined ``PUT`` s and one
  ``HEALTH`` per batch, pipelined ``GET`` s straight into the page views; no ``EXIST``, header or checksum).
  The LMCache protocol has no delete: the server keeps every round's pages (2 x pages x page bytes per
  round) until it stops.

With ``--backend nixl --compare-file`` (or ``aibrix``, ``lmcache``) the ``file`` backend also runs in every
round, on the same pool and page slots (its own directory on the same file system), and a second table
prints nixl/file.

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
from engine.cache.storage import lmcache
from engine.cache.storage.aibrix import HiCacheAibrix
from engine.cache.storage.base import HiCacheStorage, HiCacheStorageConfig
from engine.cache.storage.file import PageRanges
from engine.cache.storage.nixl import HiCacheNixl
from engine.cache.storage.registry import create_storage_backend
from engine.fleet.lmcache_server import LMCacheServer, build_env
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


class NixlRaw:
    """The nixl backend's own agent, pool registration and POSIX plugin, moving the same page buffers into
    (and out of) one plain file per page: one NIXL transfer per batch, no header, checksum or rename."""

    def __init__(self, backend: HiCacheNixl, pool: HostKVPool, directory: str, batch: int) -> None:
        self.backend, self.pool, self.directory, self.batch = backend, pool, directory, batch

    def _move(self, op: str, keys: list[str], flags: int) -> None:
        P = self.pool.page_size
        for start in range(0, len(keys), self.batch):
            part = keys[start : start + self.batch]
            fds = [os.open(os.path.join(self.directory, f"raw-{k}"), flags, 0o644) for k in part]
            try:
                host = [self.backend.host_ranges((start + i) * P) for i in range(len(part))]
                if not self.backend.xfer(op, host, fds):
                    raise RuntimeError(f"raw NIXL {op} failed")
            finally:
                for fd in fds:
                    os.close(fd)

    def write(self, keys: list[str]) -> None:
        self._move("WRITE", keys, os.O_RDWR | os.O_CREAT | os.O_TRUNC)

    def read(self, keys: list[str]) -> None:
        self._move("READ", keys, os.O_RDONLY)

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


class AibrixRaw:
    """The aibrix backend's own AIBrix manager storing the same page bytes under ``raw-`` keys: per batch
    ``allocate_for``, one copy of each page into its block, ``put``; ``acquire`` and one copy out of each
    block; no header or checksum."""

    def __init__(self, backend: HiCacheAibrix, pool: HostKVPool, batch: int) -> None:
        self.m, self.pool = backend.manager(pool.page_bytes), pool
        self.batch = min(batch, self.m.batch)
        self.pages = PageRanges(pool)

    def _batches(self, keys: list[str]):
        for start in range(0, len(keys), self.batch):
            yield start, self.m.hashes([f"raw-{k}" for k in keys[start : start + self.batch]])

    def _page(self, page: int) -> list[memoryview]:
        return self.pages.views(page * self.pool.page_size)

    def write(self, keys: list[str]) -> None:
        for start, hashes in self._batches(keys):
            handle = self.m.manager.allocate_for(None, hashes).value
            for i, block in enumerate(handle.to_tensors()):
                raw, at = block.view(-1).numpy(), 0
                for view in self._page(start + i):
                    raw[at : at + view.nbytes] = memoryview(view).cast("B")
                    at += view.nbytes
            if not self.m.manager.put(None, hashes, handle).is_ok():
                raise RuntimeError("raw AIBrix put failed")

    def read(self, keys: list[str]) -> None:
        for start, hashes in self._batches(keys):
            status = self.m.manager.acquire(None, hashes)
            if not status.is_ok():
                raise RuntimeError(f"raw AIBrix acquire failed: {status}")
            _, handle = status.value
            for i, block in enumerate(handle.to_tensors()):
                raw, at = block.view(-1).numpy(), 0
                for view in self._page(start + i):
                    memoryview(view).cast("B")[:] = raw[at : at + view.nbytes]
                    at += view.nbytes
            handle.release()

    def remove(self, keys: list[str]) -> None:
        for _, hashes in self._batches(keys):
            self.m.manager.delete(None, hashes)


class LMCacheRaw:
    """The lmcache backend's own connections moving the same page buffers as plain ``BINARY`` objects under
    other keys (the page key reversed): per batch pipelined ``PUT`` s and one ``HEALTH`` (the server has
    stored them all when it answers), pipelined ``GET`` s received straight into the page views; no
    ``EXIST``, header or checksum."""

    def __init__(self, backend: lmcache.HiCacheLMCache, pool: HostKVPool, batch: int) -> None:
        self.connections, self.pool, self.batch = backend.connections, pool, batch
        self.pages = PageRanges(pool)

    def _batches(self, keys: list[str]):
        for start in range(0, len(keys), self.batch):
            part = keys[start : start + self.batch]
            yield [self.pages.views((start + i) * self.pool.page_size) for i in range(len(part))], part

    def write(self, keys: list[str]) -> None:
        for pages, part in self._batches(keys):
            with self.connections.lend() as sock:
                for key, views in zip(part, pages, strict=True):
                    size = sum(v.nbytes for v in views)
                    lmcache.send_all(sock, [lmcache.request(lmcache.PUT, key[::-1], size), *views])
                lmcache.send_all(sock, [lmcache.request(lmcache.HEALTH, lmcache.PROBE_KEY)])
                lmcache.read_reply(sock)

    def read(self, keys: list[str]) -> None:
        for pages, part in self._batches(keys):
            with self.connections.lend() as sock:
                lmcache.send_all(sock, [lmcache.request(lmcache.GET, key[::-1]) for key in part])
                for views in pages:
                    code, length = lmcache.read_reply(sock)
                    if code != lmcache.SUCCESS or length != sum(v.nbytes for v in views):
                        raise RuntimeError(f"raw LMCache get failed: code {code}, {length} bytes")
                    for view in views:
                        lmcache.recv_into(sock, view)

    def remove(self, keys: list[str]) -> None:
        """Nothing: the protocol has no delete (the server keeps the pages until it stops)."""


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
    if isinstance(backend, lmcache.HiCacheLMCache):
        return  # no delete in LMCache's protocol
    if isinstance(backend, HiCacheAibrix):
        m = backend.manager(backend.mem_pool_host.page_bytes)
        m.manager.delete(None, m.hashes(keys))
    elif directory is not None:
        for key in keys:
            os.remove(os.path.join(directory, f"{key}.bin"))
    else:
        backend.store.batch_remove(keys, True)


def run(
    args,
    backend: HiCacheStorage,
    raw,
    pool: HostKVPool,
    directory: str | None,
    other: tuple[HiCacheStorage, str] | None = None,
) -> list[dict]:
    """Rows of ours against raw (``vs="raw"``) and, with ``other`` = (backend, its directory), of ours
    against that backend (``vs="file"``), all measured in the same rounds."""
    total = args.pages * pool.page_bytes
    steps_of: dict[str, dict[str, Callable[[list[str]], None]]] = {
        "ours": {
            "set": lambda k: ours_write(backend, pool, k, args.batch),
            "get": lambda k: ours_read(backend, pool, k, args.batch),
        },
        "raw": {"set": raw.write, "get": raw.read},
    }
    if other is not None:
        steps_of["file"] = {
            "set": lambda k: ours_write(other[0], pool, k, args.batch),
            "get": lambda k: ours_read(other[0], pool, k, args.batch),
        }
    who_all = list(steps_of)
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {
        (op, w): [] for op in ("set", "get") for w in who_all
    }
    for index in range(args.rounds):
        keys = round_keys(backend, args.pages)
        order = who_all[index % len(who_all) :] + who_all[: index % len(who_all)]
        for op in ("set", "get"):  # rotate who goes first, so none always pays another's writeback
            for who in order:
                samples[op, who].append(timed(lambda w=who, o=op, k=keys: steps_of[w][o](k)))
        raw.remove(keys)
        ours_remove(backend, keys, directory)
        if other is not None:
            ours_remove(other[0], keys, other[1])
    rows = []
    for vs in who_all[1:]:
        for op in ("set", "get"):
            ours, base = samples[op, "ours"], samples[op, vs]
            rows.append(
                {
                    "op": op,
                    "vs": vs,
                    "ours": total / statistics.median(w for w, _ in ours) / 1e9,
                    "raw": total / statistics.median(w for w, _ in base) / 1e9,
                    "ratio": statistics.median(
                        b[0] / max(o[0], 1e-9) for o, b in zip(ours, base, strict=True)
                    ),
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
        if row["vs"] == "raw":
            print(
                f"| {args.backend} | batch_{row['op']} | {args.pages * page_bytes / 1e6:.0f} MB | "
                f"{row['ours']:.2f} | {row['raw']:.2f} | {row['ratio']:.2f} | {row['cpu_ratio']:.2f} |"
            )
    against = [row for row in rows if row["vs"] == "file"]
    if against:
        print(f"same rounds, {args.backend} backend against the file backend (same pool and page slots):")
        name = args.backend
        print(f"| op | {name} GB/s | file GB/s | {name}/file wall | {name}/file CPU time |")
        print("|---|---|---|---|---|")
        for row in against:
            print(
                f"| batch_{row['op']} | {row['ours']:.2f} | {row['raw']:.2f} | {row['ratio']:.2f} | "
                f"{row['cpu_ratio']:.2f} |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["file", "mooncake", "nixl", "aibrix", "lmcache"], required=True)
    parser.add_argument("--pages", type=int, default=128, help="pages per round (default 128)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    parser.add_argument("--layers", type=int, default=30, help="default: SmolLM2-135M's 30 layers")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="pages per batch call (default 32)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", default=None, help="file / nixl backend directory (default: a temp dir)")
    parser.add_argument(
        "--compare-file",
        action="store_true",
        help="nixl, aibrix, lmcache: also time the file backend in the same rounds",
    )
    parser.add_argument(
        "--lmcache-url",
        default=None,
        help="lmcache: a running lmcache_server (lm://host:port) instead of one started for the run",
    )
    args = parser.parse_args(argv)
    if args.lmcache_url is not None and args.backend != "lmcache":
        parser.error("--lmcache-url needs --backend lmcache")
    if args.compare_file and args.backend not in ("nixl", "aibrix", "lmcache"):
        parser.error("--compare-file needs --backend nixl, aibrix or lmcache")
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
    elif args.backend in ("nixl", "aibrix", "lmcache"):
        directory = tempfile.mkdtemp(prefix="kvfleet-bench-", dir=args.dir)
        own = args.backend == "lmcache" and args.lmcache_url is None
        server = LMCacheServer(build_env()).start() if own else None
        try:
            raw: NixlRaw | AibrixRaw | LMCacheRaw
            if args.backend == "lmcache":
                url = server.url if server is not None else args.lmcache_url
                backend = create_storage_backend("lmcache", storage_config(args, {"lmcache_url": url}), pool)
                assert isinstance(backend, lmcache.HiCacheLMCache)
                raw = LMCacheRaw(backend, pool, args.batch)
            elif args.backend == "nixl":
                backend = create_storage_backend("nixl", storage_config(args, {"file_path": directory}), pool)
                assert isinstance(backend, HiCacheNixl)
                raw = NixlRaw(backend, pool, directory, args.batch)
            else:
                extra = {"l2_cache_backend": "ROCKSDB", "rocksdb_root": os.path.join(directory, "rocksdb")}
                backend = create_storage_backend("aibrix", storage_config(args, extra), pool)
                assert isinstance(backend, HiCacheAibrix)
                raw = AibrixRaw(backend, pool, args.batch)
            other = None
            if args.compare_file:
                file_dir = os.path.join(directory, "file")
                file_backend = create_storage_backend(
                    "file", storage_config(args, {"file_path": file_dir}), pool
                )
                other = (file_backend, file_dir)
            try:
                rows = run(args, backend, raw, pool, directory if args.backend == "nixl" else None, other)
            finally:
                backend.close()
        finally:
            if server is not None:
                server.stop()
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
                rows = run(args, backend, MooncakeRaw(pool, backend.store, args.batch), pool, None)
            finally:
                backend.close()
    print_table(args, rows, pool.page_bytes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
