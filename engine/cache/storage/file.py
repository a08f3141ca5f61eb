"""The ``file`` L3 backend: one file per page in a local (or shared) directory.

Follows SGLang's ``HiCacheFile`` (hicache-spec §6.4) with three deliberate differences:

* the file name is just ``<key>.bin``: keys (:mod:`engine.cache.keys`) already carry model, dtype,
  layout, page size and TP shard;
* each file starts with a fixed 512-byte header (magic ``KVFLPG01`` + JSON: key, dtype, layout,
  page_size, nbytes, xxh3_64 checksum of the payload); a truncated, mismatched or corrupt page is a miss,
  logged once per key, its file is removed so a later write can replace it, and the target buffer is
  zeroed (no corrupt bytes are left in host-pool slots);
* writes are atomic (temp file in the same directory + ``os.replace``), so readers never see half a page.

Directory: ``extra_config["file_path"]``, else env ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``, else
``/tmp/hicache``. It is created if missing; a directory that cannot be created, read or written is a
:class:`StorageConfigError` at construction naming it. The v1 methods read and write straight from/into
host-pool memory through ``host_pool.get_page_buffer_views``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from engine.cache.storage.base import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    StorageConfigError,
)

logger = logging.getLogger(__name__)

DEFAULT_DIR = "/tmp/hicache"
DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
MAGIC = b"KVFLPG01"
HEADER_SIZE = 512
_PIECE = 256 << 10  # read pieces small enough to hash while still in CPU cache
_KEY_RE = re.compile(r"[0-9a-f]{64}")


class PageFileError(Exception):
    """A page file that must not be served: truncated, mismatched header or bad checksum."""


def _read_full(fd: int, buf) -> int:
    """Read into ``buf`` until full or end of file; returns the bytes read."""
    view, got = memoryview(buf), 0
    while got < view.nbytes:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            break
        got += n
    return got


def _write_all(fd: int, buf: memoryview, offset: int | None = None) -> None:
    """Write every byte of ``buf`` at the file position (or at ``offset``), retrying short writes."""
    done = 0
    while done < buf.nbytes:
        if offset is None:
            done += os.write(fd, buf[done:])
        else:
            done += os.pwrite(fd, buf[done:], offset + done)


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's memory (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("page buffers must be contiguous")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class HiCacheFile(HiCacheStorage):
    """Page files under one directory; thread-safe; ``supports_v1`` (zero-copy via page buffer views)."""

    supports_v1 = True

    def __init__(self, storage_config: HiCacheStorageConfig) -> None:
        super().__init__(storage_config)
        extra = storage_config.extra_config
        self.file_path = str(extra.get("file_path") or os.environ.get(DIR_ENV) or DEFAULT_DIR)
        self._dtype = getattr(torch, storage_config.kv_dtype, None)
        if not isinstance(self._dtype, torch.dtype):
            raise StorageConfigError(f"kv_dtype: {storage_config.kv_dtype!r} is not a torch dtype")
        self._check_directory()
        self._reported: set[str] = set()
        self._reported_lock = threading.Lock()

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

    def _header(self, key: str, nbytes: int, checksum: int) -> bytes:
        cfg = self.storage_config
        meta = {
            "key": key,
            "dtype": cfg.kv_dtype,
            "layout": cfg.layout,
            "page_size": cfg.page_size,
            "nbytes": nbytes,
            "xxh3_64": f"{checksum:016x}",
        }
        body = MAGIC + json.dumps(meta, sort_keys=True).encode()
        return body.ljust(HEADER_SIZE, b" ")

    def _check_header(self, key: str, raw: bytes, expected_nbytes: int | None) -> dict:
        if len(raw) < HEADER_SIZE or not raw.startswith(MAGIC):
            raise PageFileError("bad or truncated header")
        try:
            meta = json.loads(raw[len(MAGIC) :].decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PageFileError(f"unreadable header ({exc})") from exc
        cfg = self.storage_config
        expected = {"key": key, "dtype": cfg.kv_dtype, "layout": cfg.layout, "page_size": cfg.page_size}
        for name, want in expected.items():
            if meta.get(name) != want:
                raise PageFileError(f"header {name} {meta.get(name)!r} != expected {want!r}")
        nbytes = meta.get("nbytes")
        if not isinstance(nbytes, int) or (expected_nbytes is not None and nbytes != expected_nbytes):
            raise PageFileError(f"header nbytes {nbytes!r} != expected {expected_nbytes}")
        return meta

    def _reject(self, key: str, path: str, reason: str) -> None:
        """Count a page that must not be served, log it once per key, remove its file."""
        self._count(corrupt_pages=1, pages_missed=1)
        with self._reported_lock:
            first = key not in self._reported
            self._reported.add(key)
        if first:
            logger.warning("L3 file page %s treated as a miss: %s", path, reason)
        with contextlib.suppress(OSError):
            os.remove(path)

    # -- core read / write -----------------------------------------------------------------------------
    def _read_page(self, key: str, buffers: Sequence[memoryview], expected_nbytes: int | None) -> bool:
        """Fill ``buffers`` (in order) with the page's payload; False on a miss or a rejected file.

        Reads header, payload (in cache-sized pieces, each hashed while still in cache) and a 1-byte
        sentinel that only a too-long file fills.
        """
        path = self._path(key)
        header, sentinel = bytearray(HEADER_SIZE), bytearray(1)
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
            got = _read_full(fd, header)
            meta = self._check_header(key, bytes(header[:got]), expected_nbytes)
            if sum(b.nbytes for b in buffers) != meta["nbytes"]:
                raise PageFileError(f"header nbytes {meta['nbytes']} does not fit the target buffer")
            hasher = xxhash.xxh3_64()
            payload = 0
            for buf in buffers:
                for start in range(0, buf.nbytes, _PIECE):
                    piece = buf[start : start + _PIECE]
                    n = _read_full(fd, piece)
                    payload += n
                    if n < piece.nbytes:
                        raise PageFileError(f"file has {payload} payload bytes, header says {meta['nbytes']}")
                    hasher.update(piece)
            if _read_full(fd, sentinel):
                raise PageFileError(f"file has over {payload} payload bytes, header says {meta['nbytes']}")
            if hasher.hexdigest() != meta.get("xxh3_64"):
                raise PageFileError("checksum mismatch")
        except PageFileError as exc:
            for buf in buffers:  # no half-read or corrupt bytes are left behind in the target
                np.asarray(buf)[:] = 0
            self._reject(key, path, str(exc))
            return False
        except OSError as exc:
            self._count(errors=1, pages_missed=1)
            logger.warning("L3 file page %s unreadable: %s", path, exc)
            return False
        finally:
            os.close(fd)
        self._count(pages_read=1, bytes_read=meta["nbytes"])
        return True

    def _write_page(self, key: str, buffers: Sequence[memoryview]) -> bool:
        path = self._path(key)
        if os.path.exists(path):
            self._count(pages_skipped=1)
            return True
        nbytes = sum(b.nbytes for b in buffers)
        tmp = os.path.join(self.file_path, f".{key}.tmp-{uuid.uuid4().hex}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:  # payload first, each piece hashed then written while in CPU cache; header last
                os.lseek(fd, HEADER_SIZE, os.SEEK_SET)
                hasher = xxhash.xxh3_64()
                for buf in buffers:
                    for start in range(0, buf.nbytes, _PIECE):
                        piece = buf[start : start + _PIECE]
                        hasher.update(piece)
                        _write_all(fd, piece)
                _write_all(fd, memoryview(self._header(key, nbytes, hasher.intdigest())), offset=0)
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
            nbytes = self._expected_nbytes()
            if nbytes is None:
                nbytes = self._header_nbytes(key)
            target_location = torch.empty(nbytes // self._dtype.itemsize, dtype=self._dtype)
        ok = self._read_page(key, [_as_bytes(target_location)], self._expected_nbytes())
        return target_location if ok else None

    def batch_get(self, keys: Sequence[str], target_locations=None, target_sizes=None) -> list:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets, strict=True)]

    def set(
        self, key: str, value: torch.Tensor | None = None, target_location=None, target_sizes=None
    ) -> bool:
        """Store the flat page tensor ``value``; True if written or already present."""
        if value is None:
            raise ValueError("set() needs the page tensor in value")
        return self._write_page(key, [_as_bytes(value.contiguous())])

    def batch_set(self, keys: Sequence[str], values=None, target_locations=None, target_sizes=None) -> bool:
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set() needs one page tensor per key in values")
        return all(self.set(key, value) for key, value in zip(keys, values, strict=True))

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    # -- v1 zero-copy path -----------------------------------------------------------------------------
    def _views(self, first_slot: int) -> list[memoryview]:
        return [_as_bytes(v) for v in self.mem_pool_host.get_page_buffer_views(first_slot)]

    def batch_get_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read each page straight into its host-pool slots (no intermediate copy)."""
        slots = self._first_slots(keys, host_indices)
        nbytes = self.mem_pool_host.page_bytes
        return [self._read_page(k, self._views(s), nbytes) for k, s in zip(keys, slots, strict=True)]

    def batch_set_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write each page straight from its host-pool slots; existing pages are skipped (True)."""
        slots = self._first_slots(keys, host_indices)
        return [self._write_page(k, self._views(s)) for k, s in zip(keys, slots, strict=True)]

    # -- housekeeping ----------------------------------------------------------------------------------
    def _expected_nbytes(self) -> int | None:
        return None if self.mem_pool_host is None else int(self.mem_pool_host.page_bytes)

    def _header_nbytes(self, key: str) -> int:
        """Payload size a page file's header claims; 0 if missing or unreadable (the read then rejects it)."""
        try:
            with open(self._path(key), "rb") as f:
                raw = f.read(HEADER_SIZE)
            return max(0, int(json.loads(raw[len(MAGIC) :].decode())["nbytes"]))
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def clear(self) -> None:
        """Delete every page file (and leftover temp files) in the directory; other files are kept."""
        for name in os.listdir(self.file_path):
            if name.endswith(".bin") or (name.startswith(".") and ".tmp-" in name):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.file_path, name))
