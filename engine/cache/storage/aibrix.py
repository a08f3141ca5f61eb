"""The ``aibrix`` L3 backend on AIBrix KVCache's cache manager (SGLang ``AibrixKVCacheStorage``,
docs/upstream.md H6).

As upstream's, the backend is an ``aibrix_kvcache.BaseKVCacheManager`` addressed by block hashes
(``BlockHashes``: one 64-hex page key per block of ``page_size`` tokens): a write is ``allocate_for`` (blocks
from AIBrix's own allocator), a copy of each page into its block, then ``put``; a read is ``acquire`` (the
leading blocks found) and a copy out of each block; existence is ``exists``. AIBrix's L2 connector (its "L2
cache") is the store: ``ROCKSDB`` and ``SHFS`` on a local or shared disk, ``MOCK`` in memory, and the cluster
stores (``INFINISTORE``, ``HPKV``, ``PRISKV``/``PRIS``, ``EIC``, with a meta service for placement) passed
through as configured.

Configuration is AIBrix's own: its ``AIBRIX_KV_CACHE_OL_*`` environment variables, each of which may also
be given in the extra config under its full name or under the rest of its name in lower case
(``{"l2_cache_backend": "ROCKSDB", "rocksdb_root": "/l3"}``), so a storage profile attached at run time
carries it. The extra config wins over the environment; the manager reads both once, at construction.
An extra-config key that is no AIBrix setting, a value that is not a scalar, or a setting KVFleet cannot
serve is a :class:`StorageConfigError` naming the key.

What is KVFleet's own (docs/architecture.md, Decisions):

* each block is opaque bytes (``uint8``, one head of one layer, wide enough for the page): a
  ``HEADER_BYTES`` header (the ``file`` backend's fields: key, dtype, layout, page size, payload bytes,
  xxh3_64 of the payload, :mod:`engine.cache.storage.page_file`), then the page in the host pool's flat
  order, then zero padding. Upstream writes the raw K/V tensors in AIBrix's NCLD layout with no check; here
  a read whose header or checksum does not match is a miss, counted in ``corrupt_pages``, its target
  zeroed and the block deleted. A block is as wide as the stored unit: the page, or with ``tp_lcm_size``
  one KV-head storage shard of it (the same bytes at every TP size sharing the namespace); each width is an
  AIBrix partition (a RocksDB database) of its own, and a generic call with another size opens its own;
* AIBrix's L1 (an in-process CPU cache in front of the store) is off by default and refused when turned on:
  the host pool is the L2 tier here, and pages kept only in AIBrix's L1 would reach no other worker;
* ``AIBRIX_KV_CACHE_OL_DEVICE`` must be ``cpu`` (the host pool's memory); without CUDA, AIBrix's allocator
  is told not to pin its slabs (pinning needs a CUDA driver);
* store errors are not raised: an error status or exception fails the call's pages and is counted in
  ``errors`` (a miss is ``NOT_FOUND``, not an error), which is what the circuit breaker watches;
* importing ``aibrix_kvcache`` sets uvloop's event-loop policy for the whole process; the policy in force
  before is put back, so only the manager's own loop thread runs AIBrix's coroutines.

A ``ROCKSDB`` store is one RocksDB database per (root, namespace, block width, rank whose keys it holds),
which one process opens at a time: the ranks of a TP worker hold one each, but a second live worker on the
same root fails to attach (naming ``AIBRIX_KV_CACHE_OL_ROCKSDB_ROOT``), as do the ranks after the first of a
TP worker whose keys name no rank (MLA, ``tp_lcm_size``); a worker started after the writer closed it
(detach, exit) reads its pages. ``SHFS`` and the cluster stores have no such limit. Calls into one manager
are serialized (a lock per manager): the backup and prefetch threads take turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from engine.cache.storage import page_file
from engine.cache.storage.base import HiCacheStorageConfig, HiCacheStorageExtraInfo, StorageConfigError
from engine.cache.storage.byte_pages import BytePageStorage, Views
from engine.cache.storage.extra_keys import AIBRIX_ENV_PREFIX as ENV_PREFIX
from engine.cache.storage.extra_keys import aibrix_setting, aibrix_setting_names
from engine.cache.storage.page_file import PageFileError, PageIdentity
from engine.cache.storage.shards import shard_map

logger = logging.getLogger(__name__)

FLAG = "--hicache-storage-backend aibrix"
HEADER_BYTES = 128  # page_file's header fields (100 bytes), zero-padded
MAX_MODEL_LEN = 102400  # upstream's ModelSpec (AIBrix sizes its allocator with it and its chunk size)
L2_BACKENDS = ("ROCKSDB", "SHFS", "MOCK", "INFINISTORE", "HPKV", "PRISKV", "PRIS", "EIC")
DEFAULTS = {"L1_CACHE_ENABLED": "0"}  # KVFleet's own; everything else is AIBrix's default

_env_lock = threading.Lock()  # os.environ holds the settings while a manager is built


def load_aibrix() -> Any:
    """The ``aibrix_kvcache`` module, imported with the caller's event-loop policy kept and slab pinning off
    where CUDA is absent. Raises :class:`StorageConfigError` naming the flag and requirements file when it
    cannot be imported."""
    policy = asyncio.get_event_loop_policy()
    try:
        import aibrix_kvcache
        from aibrix_kvcache import cache_manager
    except ImportError as exc:
        raise StorageConfigError(
            f"{FLAG} needs the aibrix-kvcache package (requirements-aibrix.txt, installed with --no-deps): "
            f"{exc}"
        ) from exc
    finally:
        asyncio.set_event_loop_policy(policy)
    if not torch.cuda.is_available():
        cache_manager.TESTING_DISABLE_PIN_MEMORY = True  # pin_memory needs a CUDA driver
    # AIBrix wraps each fetched value's read-only bytes in a tensor it only copies from
    warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning, "aibrix_kvcache")
    return aibrix_kvcache


def _text(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int | float | str):
        return str(value)
    raise StorageConfigError(f"{key}: must be a string, number or bool, got {type(value).__name__}")


def resolve_settings(extra: dict, page_size: int, environ: dict | None = None) -> dict[str, str]:
    """The AIBrix settings (name without prefix -> text) a manager is built with: KVFleet's ``DEFAULTS``,
    then the ``AIBRIX_KV_CACHE_OL_*`` environment, then the extra config (full names or lower-case rest).

    Raises :class:`StorageConfigError` naming the key: not an AIBrix setting, a non-scalar value, an
    import-time setting in the extra config, no or an unknown L2 backend, L1 turned on, a device other than
    cpu, a block size other than ``page_size``."""
    env = os.environ if environ is None else environ
    names = aibrix_setting_names()
    if names is None:
        load_aibrix()  # not installed: raises naming the requirements file
        names = []
    settings = dict(DEFAULTS)
    settings.update({k[len(ENV_PREFIX) :]: v for k, v in env.items() if k.startswith(ENV_PREFIX)})
    given: dict[str, str] = {}  # name -> the key it was given under
    for key, value in extra.items():
        try:
            name = aibrix_setting(key, names)  # the check the flag parser runs (extra_keys.py)
        except ValueError as exc:
            raise StorageConfigError(str(exc)) from None
        settings[name], given[name] = _text(key, value), key

    def named(name: str) -> str:
        return given.get(name, ENV_PREFIX + name)

    backend = settings.get("L2_CACHE_BACKEND", "").strip().upper()
    if not backend:
        raise StorageConfigError(
            f"{named('L2_CACHE_BACKEND')}: no AIBrix L2 backend set; pages would reach no other worker "
            f"(one of {', '.join(L2_BACKENDS)})"
        )
    if backend not in L2_BACKENDS:
        raise StorageConfigError(
            f"{named('L2_CACHE_BACKEND')}: unknown AIBrix L2 backend {backend!r}; "
            f"one of {', '.join(L2_BACKENDS)}"
        )
    if settings.get("L1_CACHE_ENABLED", "").strip().lower() in ("1", "true"):
        raise StorageConfigError(
            f"{named('L1_CACHE_ENABLED')}: AIBrix's L1 must stay off under KVFleet (the host pool is the L2 "
            "tier; pages AIBrix keeps in its L1 reach no other worker)"
        )
    if settings.get("DEVICE", "cpu").strip().lower() != "cpu":
        raise StorageConfigError(f"{named('DEVICE')}: must be cpu (pages move to and from the host pool)")
    block = settings.get("BLOCK_SIZE", "-1").strip()
    if block not in ("", "-1") and block != str(page_size):
        raise StorageConfigError(
            f"{named('BLOCK_SIZE')}: {block} tokens per block; must be unset or the page size ({page_size})"
        )
    return settings


@contextlib.contextmanager
def _environment(settings: dict[str, str]) -> Iterator[None]:
    """``os.environ`` holding exactly ``settings`` as ``AIBRIX_KV_CACHE_OL_*`` for the block (AIBrix reads
    its settings from there); the variables as they were afterwards."""
    with _env_lock:
        saved = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
        for key in saved:
            del os.environ[key]
        os.environ.update({ENV_PREFIX + k: v for k, v in settings.items()})
        try:
            yield
        finally:
            for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
                del os.environ[key]
            os.environ.update(saved)


class _Manager:
    """One AIBrix cache manager for blocks holding pages of ``nbytes`` payload bytes."""

    def __init__(self, ak: Any, settings: dict[str, str], page_size: int, nbytes: int, part: int) -> None:
        width = -(-(HEADER_BYTES + nbytes) // (2 * page_size))  # bytes per token per K/V half, rounded up
        spec = ak.KVCacheBlockSpec(
            block_ntokens=page_size,
            block_dtype=torch.uint8,
            block_layout=ak.KVCacheBlockLayout.NCLD,
            # AIBrix partitions its store by head and layer ids: the head id names the width, so blocks of
            # each size get a partition (a RocksDB database) of their own; the layer id ``part`` the rank
            # whose keys these are (see HiCacheAibrix._part)
            tensor_spec=ak.KVCacheTensorSpec(heads=[width], layers=[part], head_size=width),
        )
        self.ak, self.page_size, self.nbytes = ak, page_size, nbytes
        with _environment(settings):
            try:
                self.manager = ak.BaseKVCacheManager(
                    ak.KVCacheConfig(block_spec=spec, model_spec=ak.ModelSpec(MAX_MODEL_LEN))
                )
            except Exception as exc:
                raise StorageConfigError(_start_error(settings, exc)) from exc
        self.batch = max(1, self.manager.chunk_size // page_size)  # blocks per call (AIBrix's allocator)
        self.lock = threading.Lock()

    def hashes(self, keys: Sequence[str]) -> Any:
        return self.ak.BlockHashes(list(keys), self.page_size)

    def close(self) -> None:
        with self.lock:
            self.manager.close()


def _start_error(settings: dict[str, str], exc: Exception) -> str:
    backend = settings.get("L2_CACHE_BACKEND", "").strip().upper()
    where = {
        "ROCKSDB": "ROCKSDB_ROOT",
        "SHFS": "SHFS_ROOT",
        "INFINISTORE": "INFINISTORE_HOST_ADDR",
        "HPKV": "HPKV_REMOTE_ADDR",
        "PRISKV": "PRISKV_REMOTE_ADDR",
        "PRIS": "PRIS_REMOTE_ADDR",
        "EIC": "EIC_CONFIG_FILE",
    }.get(backend)
    detail = f" {ENV_PREFIX}{where}={settings.get(where, '(default)')!s}" if where else ""
    return f"{ENV_PREFIX}L2_CACHE_BACKEND={backend}:{detail} AIBrix KVCache did not start: {exc}"


class HiCacheAibrix(BytePageStorage):
    """L3 pages in AIBrix KVCache's L2 store; thread-safe; ``supports_v1`` (each page copied once between
    its host-pool slots and its AIBrix block).

    Raises :class:`StorageConfigError` at construction for a bad configuration (naming the key) or
    ``aibrix_kvcache`` missing, and when the store does not start (at ``register_mem_pool_host``, which
    opens the manager for the stored unit: a page, or a ``tp_lcm_size`` shard)."""

    def __init__(self, storage_config: HiCacheStorageConfig) -> None:
        super().__init__(storage_config)
        self._ak = load_aibrix()
        self.settings = resolve_settings(storage_config.extra_config, storage_config.page_size)
        self._managers: dict[int, _Manager] = {}
        self._managers_lock = threading.Lock()
        self._unit = 0  # bytes of the stored unit (a page, or a tp_lcm_size shard): set with the host pool

    # -- managers, one per payload size ----------------------------------------------------------------
    def manager(self, nbytes: int) -> _Manager:
        """The AIBrix manager of ``nbytes``-byte payloads (made on first use, then shared)."""
        with self._managers_lock:
            found = self._managers.get(nbytes)
            if found is None:
                found = _Manager(self._ak, self.settings, self.storage_config.page_size, nbytes, self._part())
                self._managers[nbytes] = found
            return found

    def _part(self) -> int:
        """The partition (layer id) of this rank's blocks: its rank where its keys name it (each rank
        process then opens a RocksDB database of its own), else 0, shared by every rank and TP size (MLA's
        replicated KV, ``tp_lcm_size`` shards)."""
        cfg = self.storage_config
        return 0 if cfg.tp_lcm_size is not None or cfg.is_mla_model else cfg.tp_rank

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Map the pool's pages to byte views and open the manager for the stored unit (the store starts or
        fails here): the page, or with ``tp_lcm_size`` one KV-head storage shard of it, whose bytes every TP
        size sharing the namespace agrees on (:func:`engine.cache.storage.shards.shard_map`)."""
        cfg, self._unit = self.storage_config, mem_pool_host.page_bytes
        if cfg.tp_lcm_size is not None and not cfg.is_mla_model:
            shards = shard_map(
                cfg.tp_lcm_size, cfg.tp_size, (cfg.tp_rank, cfg.tp_size), mem_pool_host.num_kv_heads
            )
            self._unit = mem_pool_host.page_bytes // shards.count
        self.manager(self._unit)
        super().register_mem_pool_host(mem_pool_host)

    def close(self) -> None:
        """Flush and close every manager (a RocksDB store is free for another process afterwards)."""
        with self._managers_lock:
            managers, self._managers = list(self._managers.values()), {}
        for m in managers:
            try:
                m.close()
            except Exception as exc:
                logger.warning("AIBrix KVCache: closing a manager: %s", exc)
        super().close()

    def _identity(self, key: str) -> PageIdentity:
        cfg = self.storage_config
        return PageIdentity(key, cfg.kv_dtype, cfg.layout, cfg.page_size)

    # -- core read / write (pages of one size) ---------------------------------------------------------
    def _write(self, keys: Sequence[str], pages: Sequence[Views]) -> list[bool]:
        """Store each page (its views, in order) under its key; pages already stored are kept (True)."""
        if not keys:
            return []
        m = self.manager(sum(v.nbytes for v in pages[0]))
        results: list[bool] = []
        for start in range(0, len(keys), m.batch):
            part = keys[start : start + m.batch]
            results += self._write_batch(m, part, pages[start : start + m.batch])
        return results

    def _write_batch(self, m: _Manager, keys: Sequence[str], pages: Sequence[Views]) -> list[bool]:
        n, have = len(keys), 0
        with m.lock:
            try:
                found = m.manager.exists(None, m.hashes(keys))
                have = found.value // m.page_size if found.is_ok() else 0
                if have:
                    self._count(pages_skipped=have)
                if have == n:
                    return [True] * n
                todo = keys[have:]
                status = m.manager.allocate_for(None, m.hashes(todo))
                if not status.is_ok():
                    raise RuntimeError(f"allocate_for: {status.error_code.name} {status.value or ''}")
                handle = status.value
                try:
                    blocks = handle.to_tensors()
                    if len(blocks) < len(todo):
                        logger.warning("AIBrix KVCache: %d of %d blocks allocated", len(blocks), len(todo))
                        todo = todo[: len(blocks)]
                    for key, block, views in zip(todo, blocks, pages[have:], strict=False):
                        self._fill_block(key, block, views)
                except BaseException:
                    handle.release()
                    raise
                put = m.manager.put(None, m.hashes(todo), handle)
                if not put.is_ok():
                    raise RuntimeError(f"put: {put.error_code.name} {put.value or ''}")
                stored = min(len(todo), put.value // m.page_size)
            except Exception as exc:
                self._count(errors=1)
                logger.warning("L3 aibrix: %d pages not written: %s", n - have, exc)
                return [True] * have + [False] * (n - have)
        self._count(pages_written=stored, bytes_written=stored * m.nbytes)
        if stored < n - have:
            self._count(errors=1)
        return [True] * (have + stored) + [False] * (n - have - stored)

    def _fill_block(self, key: str, block: torch.Tensor, views: Views) -> None:
        raw = block.view(-1).numpy()
        checksum = page_file.checksum(views)
        nbytes = sum(v.nbytes for v in views)
        raw[:HEADER_BYTES] = np.frombuffer(
            page_file.pack_header(self._identity(key), nbytes, checksum, size=HEADER_BYTES), np.uint8
        )
        at = HEADER_BYTES
        for v in views:
            raw[at : at + v.nbytes] = np.frombuffer(v, np.uint8)
            at += v.nbytes
        raw[at:] = 0

    def _read(self, keys: Sequence[str], pages: Sequence[Views]) -> list[bool]:
        """Fill each page's views from its block; per key True, or False for a miss, a rejected block
        (target zeroed) or a failed call. Blocks after the first miss of a batch are misses (AIBrix's
        ``acquire`` returns the leading run)."""
        if not keys:
            return []
        m = self.manager(sum(v.nbytes for v in pages[0]))
        results: list[bool] = []
        for start in range(0, len(keys), m.batch):
            results += self._read_batch(m, keys[start : start + m.batch], pages[start : start + m.batch])
        return results

    def _read_batch(self, m: _Manager, keys: Sequence[str], pages: Sequence[Views]) -> list[bool]:
        results = [False] * len(keys)
        bad: list[str] = []
        with m.lock:
            status: Any = None
            error: Any = None
            try:
                status = m.manager.acquire(None, m.hashes(keys))
            except Exception as exc:
                error = exc
            else:
                error = None if status.is_ok() or status.is_not_found() else status
            if error is not None:
                self._count(errors=1, pages_missed=len(keys))
                logger.warning("L3 aibrix: %d pages not read: %s", len(keys), error)
                return results
            if not status.is_ok():
                self._count(pages_missed=len(keys))
                return results
            ntokens, handle = status.value
            try:
                blocks = handle.to_tensors()[: ntokens // m.page_size]
                for i, block in enumerate(blocks):
                    try:
                        self._copy_out(keys[i], block, pages[i])
                    except PageFileError as exc:
                        for v in pages[i]:
                            np.asarray(v)[:] = 0  # no corrupt bytes are left behind in the target
                        self._count(corrupt_pages=1, pages_missed=1)
                        logger.warning("L3 aibrix page %s treated as a miss: %s", keys[i], exc)
                        bad.append(keys[i])
                        continue
                    results[i] = True
                    self._count(pages_read=1, bytes_read=m.nbytes)
            finally:
                handle.release()
            self._count(pages_missed=len(keys) - len(blocks))
            for key in bad:  # removed so a later write can replace it
                with contextlib.suppress(Exception):
                    m.manager.delete(None, m.hashes([key]))
        return results

    def _copy_out(self, key: str, block: torch.Tensor, views: Views) -> None:
        raw = block.view(-1).numpy()
        want = sum(v.nbytes for v in views)
        nbytes, checksum = page_file.check_identity(raw[:HEADER_BYTES].tobytes(), self._identity(key))
        if nbytes != want:
            raise PageFileError(f"header nbytes {nbytes} != expected {want}")
        at = HEADER_BYTES
        for v in views:
            np.asarray(v)[:] = raw[at : at + v.nbytes]
            at += v.nbytes
        if page_file.checksum(views) != checksum:
            raise PageFileError("checksum mismatch")

    def batch_exists(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading keys stored (AIBrix's ``exists``), asked of the stored unit's partition (a page, or a
        ``tp_lcm_size`` shard)."""
        if not keys:
            return 0
        if self.mem_pool_host is None:
            raise ValueError("batch_exists() needs a registered host pool")
        m = self.manager(self._unit)
        count = 0
        for start in range(0, len(keys), m.batch):
            part = keys[start : start + m.batch]
            with m.lock:
                try:
                    found = m.manager.exists(None, m.hashes(part))
                except Exception as exc:
                    self._count(errors=1)
                    logger.warning("L3 aibrix: exists failed: %s", exc)
                    return count
            if not found.is_ok():
                if not found.is_not_found():
                    self._count(errors=1)
                    logger.warning("L3 aibrix: exists failed: %s", found)
                return count
            count += found.value // m.page_size
            if found.value // m.page_size < len(part):
                return count
        return count
