"""The ``file`` L3 backend: one file per page in a local (or shared) directory.

Follows SGLang's ``HiCacheFile`` (docs/upstream.md H6) with three differences (docs/architecture.md,
Decisions):

* the file name is just ``<key>.bin``: keys (:mod:`engine.cache.keys`) already carry model, dtype,
  layout, page size and TP shard;
* each file starts with a small header (:mod:`engine.cache.storage.page_file`: key, dtype, layout,
  page size, byte count, xxh3_64 checksum); a truncated, mismatched or corrupt page is a miss, logged
  once per key, a damaged file is removed so a later write can replace it (a page of another size
  under the same key is only skipped), and the target buffer is zeroed (no corrupt bytes are left in
  host-pool slots);
* writes are atomic (temp file in the same directory + ``os.replace``), so readers never see half a page.

Directory: ``extra_config["file_path"]`` or upstream SGLang's name for it, ``file_storage_path`` (so one
storage profile serves KVFleet and upstream workers alike), else env
``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``, else ``/tmp/hicache``. It is created if missing; a directory
that cannot be created, read or written is a
:class:`StorageConfigError` at construction naming it. The v1 methods read and write straight from/into
host-pool memory: the byte ranges of each page inside ``kv_buffer`` are worked out once at
``register_mem_pool_host`` (:class:`PageRanges`), so a page costs no torch call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import uuid
from collections.abc import Sequence

import numpy as np
import torch

from engine.cache.storage import page_file
from engine.cache.storage.base import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    StorageConfigError,
)
from engine.cache.storage.page_file import PageFileError, PageIdentity

logger = logging.getLogger(__name__)

DEFAULT_DIR = "/tmp/hicache"
DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
_KEY_RE = re.compile(r"[0-9a-f]{64}")


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's memory (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("page buffers must be contiguous")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy declares it for 3.12+ only


class PageRanges:
    """Where each host page lies in the pool's ``kv_buffer``, as byte views (no torch call per page).

    Like upstream's ``get_page_buffer_meta`` (pointers by arithmetic): the ranges of page ``p`` are those
    of page 0 (from ``get_page_buffer_views``) shifted by ``p`` times the page stride, which holds for
    every host layout; checked against the pool's own views of the second and last page. Raises
    :class:`StorageConfigError` for a pool whose page views are not contiguous or not evenly spaced.
    """

    def __init__(self, pool) -> None:
        self.page_size, self.page_num = pool.page_size, pool.page_num
        self.memory = _as_bytes(pool.kv_buffer)
        base = pool.kv_buffer.data_ptr()

        def ranges(page: int) -> list[tuple[int, int]]:
            views = pool.get_page_buffer_views(page * self.page_size)
            if not all(v.is_contiguous() for v in views):
                raise StorageConfigError("host pool page views must be contiguous for the file backend")
            return [(v.data_ptr() - base, v.numel() * v.element_size()) for v in views]

        self.first = ranges(0)
        self.stride = ranges(1)[0][0] - self.first[0][0] if self.page_num > 1 else 0
        for page in {1, self.page_num - 1} if self.page_num > 1 else ():
            if ranges(page) != self._ranges(page):
                raise StorageConfigError("host pool pages are not evenly spaced in kv_buffer")

    def _ranges(self, page: int) -> list[tuple[int, int]]:
        shift = page * self.stride
        return [(offset + shift, nbytes) for offset, nbytes in self.first]

    def ranges(self, first_slot: int) -> list[tuple[int, int]]:
        """(byte offset in ``kv_buffer``, byte count) of each piece of the page starting at host slot
        ``first_slot``, in page order. Raises ``ValueError`` for a slot that is not the first slot of a
        page of this pool."""
        page, rest = divmod(first_slot, self.page_size)
        if rest or not 0 <= page < self.page_num:
            raise ValueError(f"slot {first_slot} is not the first slot of a host pool page")
        return self._ranges(page)

    def views(self, first_slot: int) -> list[memoryview]:
        """Writable byte views (no copy) of the page starting at host slot ``first_slot``, in page order.

        Raises ``ValueError`` for a slot that is not the first slot of a page of this pool.
        """
        return [self.memory[offset : offset + nbytes] for offset, nbytes in self.ranges(first_slot)]


class HiCacheFile(HiCacheStorage):
    """Page files under one directory; thread-safe; ``supports_v1`` (zero-copy via page buffer views)."""

    supports_v1 = True
    log_name = "file"
    dir_env = DIR_ENV  # the environment variable naming the directory when the extra config does not
    default_dir = DEFAULT_DIR

    def __init__(self, storage_config: HiCacheStorageConfig) -> None:
        super().__init__(storage_config)
        extra = storage_config.extra_config
        given = extra.get("file_path") or extra.get("file_storage_path")
        self.file_path = str(given or os.environ.get(self.dir_env) or self.default_dir)
        dtype = getattr(torch, storage_config.kv_dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise StorageConfigError(f"kv_dtype: {storage_config.kv_dtype!r} is not a torch dtype")
        self._dtype = dtype
        self._check_directory()
        self._reported: set[str] = set()
        self._reported_lock = threading.Lock()
        self._pages: PageRanges | None = None

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Remember the host pool and map its pages to byte views once (see :class:`PageRanges`)."""
        self._pages = PageRanges(mem_pool_host)
        super().register_mem_pool_host(mem_pool_host)

    def close(self) -> None:
        self._pages = None
        super().close()

    def _check_directory(self) -> None:
        probe = os.path.join(self.file_path, f".probe-{uuid.uuid4().hex}")
        try:
            os.makedirs(self.file_path, exist_ok=True)
            os.listdir(self.file_path)
            with open(probe, "wb") as f:
                f.write(b"probe")
            with open(probe, "rb") as f:
                f.read()
            os.remove(probe)
        except OSError as exc:
            raise StorageConfigError(
                f"file_path: storage directory {self.file_path!r} is not usable (need read/write): {exc}"
            ) from exc

    # -- naming and header -----------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
            raise ValueError(f"storage key must be 64 lowercase hex characters, got {key!r}")
        return os.path.join(self.file_path, f"{key}.bin")

    def _identity(self, key: str) -> PageIdentity:
        cfg = self.storage_config
        return PageIdentity(key, cfg.kv_dtype, cfg.layout, cfg.page_size)

    def _reject(self, key: str, path: str, reason: str, remove: bool) -> None:
        """Count a page that must not be served, log it once per key, remove its file if damaged."""
        self._count(corrupt_pages=1, pages_missed=1)
        with self._reported_lock:
            first = key not in self._reported
            self._reported.add(key)
        if first:  # logged under the backend's own module (file, or nixl that reuses this)
            logging.getLogger(type(self).__module__).warning(
                "L3 %s page %s treated as a miss: %s", self.log_name, path, reason
            )
        if remove:
            with contextlib.suppress(OSError):
                os.remove(path)

    # -- core read / write -----------------------------------------------------------------------------
    def _read_page(self, key: str, buffers: Sequence[memoryview]) -> bool:
        """Fill ``buffers`` (in order) with the page's payload; False on a miss or a rejected file."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._count(pages_missed=1)
            return False
        except OSError as exc:
            self._count(errors=1, pages_missed=1)
            logger.warning("L3 file page %s unreadable: %s", path, exc)
            return False
        try:
            nbytes = page_file.read_page(fd, self._identity(key), buffers)
        except PageFileError as exc:
            for buf in buffers:  # no half-read or corrupt bytes are left behind in the target
                np.asarray(buf)[:] = 0
            self._reject(key, path, str(exc), remove=exc.damaged)
            return False
        except OSError as exc:
            self._count(errors=1, pages_missed=1)
            logger.warning("L3 file page %s unreadable: %s", path, exc)
            return False
        finally:
            os.close(fd)
        self._count(pages_read=1, bytes_read=nbytes)
        return True

    def _write_page(self, key: str, buffers: Sequence[memoryview]) -> bool:
        """Write a page atomically (temp file + rename); an existing page is kept (True)."""
        path = self._path(key)
        if os.path.exists(path):
            self._count(pages_skipped=1)
            return True
        tmp = os.path.join(self.file_path, f".{key}.tmp-{uuid.uuid4().hex}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                nbytes = page_file.write_page(fd, self._identity(key), buffers)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            self._count(errors=1)
            logger.warning("L3 file page %s not written: %s", path, exc)
            with contextlib.suppress(OSError):
                os.remove(tmp)
            return False
        self._count(pages_written=1, bytes_written=nbytes)
        return True

    # -- generic path ----------------------------------------------------------------------------------
    def get(
        self, key: str, target_location: torch.Tensor | None = None, target_sizes=None
    ) -> torch.Tensor | None:
        """The flat page under ``key`` (1-D, ``kv_dtype``), read into ``target_location`` when given.

        Without a target, the page size comes from the registered host pool's ``page_bytes`` (or the
        header when no pool is registered). Returns None on a miss or a rejected file.
        """
        if target_location is None:
            if self.mem_pool_host is not None:
                nbytes = self.mem_pool_host.page_bytes
            else:
                nbytes = page_file.read_payload_size(self._path(key))
            target_location = torch.empty(nbytes // self._dtype.itemsize, dtype=self._dtype)
        ok = self._read_page(key, [_as_bytes(target_location)])
        return target_location if ok else None

    def set(
        self, key: str, value: torch.Tensor | None = None, target_location=None, target_sizes=None
    ) -> bool:
        """Store the flat page tensor ``value``; True if written or already present."""
        if value is None:
            raise ValueError("set() needs the page tensor in value")
        return self._write_page(key, [_as_bytes(value.contiguous())])

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    # -- v1 zero-copy path -----------------------------------------------------------------------------
    def batch_get_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read each page straight into its host-pool slots (no intermediate copy)."""
        slots = self._first_slots(keys, host_indices)
        assert self._pages is not None, "set with the host pool (_first_slots raised otherwise)"
        return [self._read_page(k, self._pages.views(s)) for k, s in zip(keys, slots, strict=True)]

    def batch_set_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write each page straight from its host-pool slots; existing pages are skipped (True)."""
        slots = self._first_slots(keys, host_indices)
        assert self._pages is not None, "set with the host pool (_first_slots raised otherwise)"
        return [self._write_page(k, self._pages.views(s)) for k, s in zip(keys, slots, strict=True)]

    # -- housekeeping ----------------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete every page file (and leftover temp files) in the directory; other files are kept."""
        for name in os.listdir(self.file_path):
            if name.endswith(".bin") or (name.startswith(".") and ".tmp-" in name):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.file_path, name))
