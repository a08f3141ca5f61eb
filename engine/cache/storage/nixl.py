"""The ``nixl`` L3 backend: page files moved by NIXL's POSIX storage plugin (SGLang ``HiCacheNixl``,
docs/upstream.md H6).

As upstream's, the backend is a NIXL agent with a storage plugin instead of a network backend: the host
pool's ``kv_buffer`` is registered with the agent once (``register_mem_pool_host``) and every batch of
pages is one NIXL transfer between those DRAM ranges and file descriptors (``READ``: file -> host pool,
``WRITE``: host pool -> file), so the v1 path moves bytes straight between the pool and the files with no
copy through Python. Existence is asked of NIXL too (``query_memory`` on the page files).

What is KVFleet's own (docs/architecture.md, Decisions):

* the files are the ``file`` backend's (:mod:`engine.cache.storage.page_file`): ``<key>.bin`` holding the
  4096-byte header (key, dtype, layout, page size, payload bytes, xxh3_64) and the payload at offset 4096,
  written to a temporary file that is renamed into place once NIXL says the write is DONE. So a ``file``
  and a ``nixl`` worker share one directory, and a damaged, truncated or mismatched page is a miss
  (counted in ``corrupt_pages``, its host slots zeroed, the file removed when damaged) exactly as with
  ``file``. The header is written and checked by Python (one 4 KiB ``pwrite``/``pread`` per page), the
  checksum computed over the host-pool bytes before a write and after a read;
* only the POSIX plugin: ``plugin`` ``auto`` (the default) means POSIX here; GDS / GDS_MT need a GPU and
  cuFile, 3FS and the object plugins their services, so any other plugin is a :class:`StorageConfigError`
  naming ``plugin``;
* upstream's ``get``/``set`` raise (deprecated); here they work (through NIXL, registering the caller's
  tensor for the call), since ``tp_lcm_size`` shards go through them.

Directory: ``extra_config["file_path"]``, else env ``SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR`` (upstream's),
else ``/tmp/hicache_storage`` (upstream's default); checked at construction like the ``file`` backend's.
Plugin: ``extra_config["plugin"]``, a name (``"POSIX"``, ``"auto"``) or upstream's fully qualified form
``{"posix": {"active": true, <POSIX params>}}``, else env ``SGLANG_HICACHE_NIXL_BACKEND_PLUGIN``, else
``auto``. POSIX parameters (``use_aio``, ``use_uring``, ``use_posix_aio``, ``kernel_queue_size``,
``ios_pool_size``) may also stand at the top level of the extra config (upstream's flat form).

Keys, MLA and tensor parallelism are the cache's (the page keys name the rank shard or, with MLA, none;
only the writer rank backs a page up; ``tp_lcm_size`` wraps this backend in
:class:`engine.cache.storage.shards.ShardedStorage`), as for every backend. A transfer NIXL reports as
failed, or not done within ``XFER_TIMEOUT_S``, fails every page of its batch (``errors``); no ``UCX_*``
setting matters here (the agent has no UCX backend).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.cache.storage import page_file
from engine.cache.storage.base import HiCacheStorageConfig, HiCacheStorageExtraInfo, StorageConfigError
from engine.cache.storage.file import HiCacheFile
from engine.cache.storage.page_file import HEADER_SIZE, PageFileError
from engine.nixl_common import NixlUnavailable, make_agent, wait_xfer

logger = logging.getLogger(__name__)

FLAG = "--hicache-storage-backend nixl"
DIR_ENV = "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"
PLUGIN_ENV = "SGLANG_HICACHE_NIXL_BACKEND_PLUGIN"
DEFAULT_DIR = "/tmp/hicache_storage"
PLUGINS = ("POSIX",)
POSIX_PARAMS = ("use_aio", "use_uring", "use_posix_aio", "kernel_queue_size", "ios_pool_size")
XFER_TIMEOUT_S = 60.0

Ranges = list[tuple[int, int]]  # (address, byte count) of each piece of one page, in page order


def plugin_choice(extra: dict, environ: dict | None = None) -> tuple[str, dict[str, str]]:
    """(plugin name, its init parameters as strings) from the extra config, else ``$PLUGIN_ENV``.

    Raises :class:`StorageConfigError` naming ``plugin`` for a plugin other than POSIX (``auto`` means
    POSIX) or a malformed value."""
    env = os.environ if environ is None else environ
    raw = extra.get("plugin")
    params: dict[str, Any] = {k: extra[k] for k in POSIX_PARAMS if k in extra}
    if isinstance(raw, dict):
        active = [
            (name, cfg)
            for name, cfg in raw.items()
            if isinstance(cfg, dict) and cfg.get("active") in (True, "true", "True")
        ]
        if not active:
            raise StorageConfigError(f'plugin: no plugin in {sorted(raw)} is marked "active": true')
        name, cfg = active[0]
        params = {k: v for k, v in cfg.items() if k != "active"}
    elif raw is None or isinstance(raw, str):
        name = raw or env.get(PLUGIN_ENV) or "auto"
    else:
        raise StorageConfigError(
            f'plugin: must be a plugin name or {{name: {{"active": true, ...}}}}, got {raw!r}'
        )
    plugin = name.upper()
    if plugin == "AUTO":
        plugin = "POSIX"
    if plugin not in PLUGINS:
        raise StorageConfigError(
            f"plugin: NIXL plugin {name!r} is not available to KVFleet's nixl backend (GDS needs a GPU and "
            "cuFile, 3FS and the object stores their services); use POSIX (or auto)"
        )
    return plugin, {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in params.items()}


def _address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if buf.nbytes else 0


class HiCacheNixl(HiCacheFile):
    """Page files written and read through a NIXL agent's POSIX plugin; thread-safe (the agent runs with
    NIXL's reader/writer locking); ``supports_v1`` (zero-copy from/to the registered host pool).

    Raises :class:`StorageConfigError` at construction for an unusable directory, a plugin other than
    POSIX, or NIXL (or its POSIX plugin) not loading."""

    supports_v1 = True
    log_name = "nixl"
    dir_env = DIR_ENV
    default_dir = DEFAULT_DIR

    def __init__(self, storage_config: HiCacheStorageConfig) -> None:
        super().__init__(storage_config)
        self.plugin, params = plugin_choice(storage_config.extra_config)
        self.agent_name = f"hicache_nixl_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        try:
            self.agent = make_agent(self.agent_name, [], FLAG, thread_safe=True)
        except NixlUnavailable as exc:
            raise StorageConfigError(str(exc)) from exc
        try:
            self.agent.create_backend(self.plugin, params)
        except Exception as exc:  # nixl raises its own errors from C++ (bad parameters, no plugin)
            raise StorageConfigError(
                f"plugin: NIXL could not create its {self.plugin} backend with {params} ({exc}); "
                f"plugins here: {self.agent.plugin_list}"
            ) from exc
        self._pool_reg: Any = None
        self._pool_base = 0

    # -- host pool -------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Map the pool's pages (as the ``file`` backend) and register its whole ``kv_buffer`` with NIXL
        once, so a transfer only names ranges inside it."""
        self._deregister_pool()
        super().register_mem_pool_host(mem_pool_host)
        kv = mem_pool_host.kv_buffer
        self._pool_base = kv.data_ptr()
        try:
            self._pool_reg = self.agent.register_memory(
                [(self._pool_base, kv.numel() * kv.element_size(), 0, "")], "DRAM"
            )
        except Exception as exc:
            raise StorageConfigError(f"{FLAG}: NIXL could not register the host pool ({exc})") from exc

    def _deregister_pool(self) -> None:
        if self._pool_reg is not None:
            try:
                self.agent.deregister_memory(self._pool_reg)
            except Exception as exc:
                logger.debug("NIXL: deregistering the host pool: %s", exc)
            self._pool_reg = None

    def close(self) -> None:
        self._deregister_pool()
        super().close()

    def host_ranges(self, first_slot: int) -> Ranges:
        """The (address, bytes) pieces of the host page starting at slot ``first_slot``."""
        assert self._pages is not None, "set with the host pool (_first_slots raised otherwise)"
        return [(self._pool_base + offset, n) for offset, n in self._pages.ranges(first_slot)]

    # -- one NIXL transfer per batch -------------------------------------------------------------------
    def xfer(self, op: str, host: list[Ranges], fds: list[int]) -> bool:
        """Move each page's pieces between ``host`` and the payload of file ``fds[i]`` (from
        ``HEADER_SIZE`` on) as one NIXL ``op`` (``READ``: file -> host, ``WRITE``: host -> file); True when
        NIXL reports it DONE. The files are registered for this transfer only."""
        local, far, sizes = [], [], []
        for ranges, fd in zip(host, fds, strict=True):
            offset = HEADER_SIZE
            for addr, n in ranges:
                local.append((addr, n, 0))
                far.append((offset, n, fd))
                offset += n
            sizes.append((0, offset, fd, ""))
        try:
            file_reg = self.agent.register_memory(sizes, "FILE")
        except Exception as exc:
            logger.warning("NIXL: could not register %d page files: %s", len(fds), exc)
            return False
        handle = None
        try:
            local_descs = self.agent.get_xfer_descs(local, "DRAM")
            far_descs = self.agent.get_xfer_descs(far, "FILE")
            handle = self.agent.initialize_xfer(op, local_descs, far_descs, self.agent_name)
            state = wait_xfer(self.agent, handle, XFER_TIMEOUT_S, poll_s=0.00005)
            if state != "DONE":
                logger.warning("NIXL %s of %d pages failed (%s)", op, len(fds), state)
            return state == "DONE"
        except Exception as exc:  # nixl's own errors, or TimeoutError from wait_xfer
            logger.warning("NIXL %s of %d pages failed: %s", op, len(fds), exc)
            return False
        finally:
            if handle is not None:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception as exc:  # a handle still in flight (timeout) may refuse release
                    logger.warning("NIXL: could not release a %s handle (%s)", op, exc)
            try:
                self.agent.deregister_memory(file_reg)
            except Exception as exc:
                logger.debug("NIXL: deregistering page files: %s", exc)

    def _read_pages(
        self, keys: Sequence[str], host: list[Ranges], views: list[list[memoryview]]
    ) -> list[bool]:
        """Fill each page's host ranges from its file; per key True, or False for a miss, a rejected file
        (zeroed, as the ``file`` backend) or a failed transfer."""
        results = [False] * len(keys)
        opened: list[tuple[int, int, str, int]] = []  # (index, fd, path, checksum)
        try:
            for i, key in enumerate(keys):
                path = self._path(key)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    self._count(pages_missed=1)
                    continue
                except OSError as exc:
                    self._count(errors=1, pages_missed=1)
                    logger.warning("L3 nixl page %s unreadable: %s", path, exc)
                    continue
                want = sum(n for _, n in host[i])
                try:
                    checksum = page_file.check_file(fd, self._identity(key), want)
                except (PageFileError, OSError) as exc:
                    os.close(fd)
                    self._zero(views[i])
                    if isinstance(exc, PageFileError):
                        self._reject(key, path, str(exc), remove=exc.damaged)
                    else:
                        self._count(errors=1, pages_missed=1)
                    continue
                opened.append((i, fd, path, checksum))
            if not opened:
                return results
            done = self.xfer("READ", [host[i] for i, *_ in opened], [fd for _, fd, *_ in opened])
        finally:
            for _, fd, *_ in opened:
                os.close(fd)
        for i, _, path, checksum in opened:
            if not done:
                self._zero(views[i])
                self._count(errors=1, pages_missed=1)
            elif page_file.checksum(views[i]) != checksum:
                self._zero(views[i])
                self._reject(keys[i], path, "checksum mismatch", remove=True)
            else:
                results[i] = True
                self._count(pages_read=1, bytes_read=sum(n for _, n in host[i]))
        return results

    def _write_pages(
        self, keys: Sequence[str], host: list[Ranges], views: list[list[memoryview]]
    ) -> list[bool]:
        """Write each page not stored yet: header by Python, payload by NIXL into a temp file, then renamed
        into place; an existing page is kept (True)."""
        results = [True] * len(keys)
        pending: list[tuple[int, int, str, str]] = []  # (index, fd, temp path, final path)
        try:
            for i, key in enumerate(keys):
                path = self._path(key)
                if os.path.exists(path):
                    self._count(pages_skipped=1)
                    continue
                tmp = os.path.join(self.file_path, f".{key}.tmp-{uuid.uuid4().hex}")
                try:
                    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                except OSError as exc:
                    results[i] = False
                    self._count(errors=1)
                    logger.warning("L3 nixl page %s not written: %s", path, exc)
                    continue
                nbytes = sum(n for _, n in host[i])
                try:
                    page_file.write_header(fd, self._identity(key), nbytes, page_file.checksum(views[i]))
                except OSError as exc:
                    os.close(fd)
                    with contextlib.suppress(OSError):
                        os.remove(tmp)
                    results[i] = False
                    self._count(errors=1)
                    logger.warning("L3 nixl page %s not written: %s", path, exc)
                    continue
                pending.append((i, fd, tmp, path))
            done = bool(pending) and self.xfer(
                "WRITE", [host[i] for i, *_ in pending], [p[1] for p in pending]
            )
        finally:
            for _, fd, *_ in pending:
                os.close(fd)
        for i, _, tmp, path in pending:
            try:
                if not done:
                    raise OSError("NIXL write failed")
                os.replace(tmp, path)
            except OSError as exc:
                results[i] = False
                self._count(errors=1)
                logger.warning("L3 nixl page %s not written: %s", path, exc)
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                continue
            self._count(pages_written=1, bytes_written=sum(n for _, n in host[i]))
        return results

    @staticmethod
    def _zero(views: Sequence[memoryview]) -> None:
        for buf in views:  # no half-read or corrupt bytes are left behind in the target
            np.asarray(buf)[:] = 0

    # -- generic path: the caller's buffers, registered for the call -----------------------------------
    @contextlib.contextmanager
    def _registered(self, buffers: Sequence[memoryview]):
        ranges = [(_address(b), b.nbytes) for b in buffers if b.nbytes]
        reg = self.agent.register_memory([(a, n, 0, "") for a, n in ranges], "DRAM") if ranges else None
        try:
            yield ranges
        finally:
            if reg is not None:
                self.agent.deregister_memory(reg)

    def _read_page(self, key: str, buffers: Sequence[memoryview]) -> bool:
        with self._registered(buffers) as ranges:
            return self._read_pages([key], [ranges], [list(buffers)])[0]

    def _write_page(self, key: str, buffers: Sequence[memoryview]) -> bool:
        with self._registered(buffers) as ranges:
            return self._write_pages([key], [ranges], [list(buffers)])[0]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading keys whose page file NIXL finds (``query_memory``; pages appear whole, by rename)."""
        if not keys:
            return 0
        found = self.agent.query_memory(
            [(0, 0, 0, self._path(k)) for k in keys], self.plugin, mem_type="FILE"
        )
        count = 0
        for info in found:
            if info is None:
                break
            count += 1
        return count

    # -- v1 zero-copy path -----------------------------------------------------------------------------
    def batch_get_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read the pages straight into their host-pool slots: one NIXL READ for the batch."""
        slots = self._first_slots(keys, host_indices)
        assert self._pages is not None, "set with the host pool (_first_slots raised otherwise)"
        return self._read_pages(
            keys, [self.host_ranges(s) for s in slots], [self._pages.views(s) for s in slots]
        )

    def batch_set_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write the pages straight from their host-pool slots: one NIXL WRITE for the batch; existing
        pages are skipped (True)."""
        slots = self._first_slots(keys, host_indices)
        assert self._pages is not None, "set with the host pool (_first_slots raised otherwise)"
        return self._write_pages(
            keys, [self.host_ranges(s) for s in slots], [self._pages.views(s) for s in slots]
        )
