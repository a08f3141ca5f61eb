"""The ``mooncake`` L3 backend on a real Mooncake distributed store.

Follows SGLang's ``MooncakeStore`` (docs/upstream.md H6) with these choices:

* one store object per page, key ``[<extra_backend_tag>_]<page key>`` (the page key already names model,
  dtype, layout, page size, shard and KV producer, :mod:`engine.cache.keys`); the object holds a
  ``HEADER_BYTES`` header (the file backend's: key, dtype, layout, page size, payload bytes, xxh3_64 of
  the payload, :mod:`engine.cache.storage.page_file`), the page's K plane then its V plane, written and
  read zero-copy from the registered host pool (and a registered header row per host page) with the
  store's multi-buffer batch calls (v1 interface). A read whose header or checksum does not match is a
  miss, counted in ``corrupt_pages``, its host slots zeroed and the object removed (upstream stores raw
  bytes with no check);
* ``page_first`` / ``page_first_direct`` host layouts only (a page's K and V are each one contiguous
  block); any other layout is a :class:`StorageConfigError`;
* start-up (and a runtime attach) checks that the master accepts TCP connections *and answers* (its RPC
  server closes a connection whose request header is invalid at once; a port that accepts but stays silent
  would make ``setup`` hang for minutes holding the GIL), and that an HTTP metadata server answers a GET,
  each within ``ANSWER_TIMEOUT_S``, failing with a :class:`StorageError` naming the address; after ``setup``
  a small put/get/remove round trip proves the transfer path;
* ``close`` (detach) keeps the client mounted for the next attach in this process
  (:mod:`engine.cache.storage.mooncake_clients`), so pages in its segment are not lost;
* at run time a failed store call (e.g. the master went away) is a miss or a failed write, counted in
  ``errors``; the backend then stops calling the store for a back-off window (1 s doubling to 30 s) and
  only resumes once the master answers again, so no caller waits on a dead store more than once per
  window (the store's own RPC timeout, ~30 s, bounds that wait; its calls release the GIL).
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

import torch

from engine.cache.storage import mooncake_clients, page_file
from engine.cache.storage.base import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    StorageConfigError,
    StorageError,
)
from engine.cache.storage.mooncake_config import P2P_HANDSHAKE, MooncakeConfig
from engine.cache.storage.page_file import PageFileError, PageIdentity

logger = logging.getLogger(__name__)

SUPPORTED_LAYOUTS = ("page_first", "page_first_direct")
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900  # the master did not answer: pause L3 calls (other negative codes fail one page)
_PROBE_TIMEOUT_S = 1.0
ANSWER_TIMEOUT_S = 2.0
_INVALID_HEADER = b"\x00" * 32  # not a coro_rpc request header: the master's RPC server hangs up on it
HEADER_BYTES = 128  # page_file's header fields (100 bytes), zero-padded


def _master_problem(host: str, port: int, timeout: float = ANSWER_TIMEOUT_S) -> str | None:
    """None when ``host:port`` accepts a connection and reacts (data or hang-up) to an invalid request
    header within ``timeout`` seconds, as a live Mooncake master does; else the reason."""
    try:
        with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S) as sock:
            sock.settimeout(timeout)
            sock.sendall(_INVALID_HEADER)
            sock.recv(64)
            return None
    except TimeoutError:
        return f"it accepts TCP connections but does not answer (nothing within {timeout:g} s)"
    except ConnectionResetError:
        return None
    except OSError as exc:
        return str(exc) or type(exc).__name__


def _http_problem(url: str, timeout: float = ANSWER_TIMEOUT_S) -> str | None:
    """None when ``url`` answers a GET with any HTTP status within ``timeout`` seconds, else the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except TimeoutError:
        return f"no HTTP answer within {timeout:g} s"
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


class _Backoff:
    """Circuit breaker: after a failure, refuse calls until a deadline and a successful probe."""

    def __init__(self, probe, first_s: float = 1.0, max_s: float = 30.0) -> None:
        self._probe, self._first, self._max = probe, first_s, max_s
        self._lock = threading.Lock()
        self._delay = 0.0
        self._retry_at = 0.0

    def allow(self) -> bool:
        with self._lock:
            if self._delay == 0.0:
                return True
            if time.monotonic() < self._retry_at:
                return False
        if self._probe():
            return True
        self.failed()
        return False

    def failed(self) -> None:
        with self._lock:
            self._delay = min(self._max, max(self._first, self._delay * 2))
            self._retry_at = time.monotonic() + self._delay

    def succeeded(self) -> None:
        with self._lock:
            self._delay = 0.0

    @property
    def paused(self) -> bool:
        return self._delay > 0.0


class MooncakeStore(HiCacheStorage):
    """L3 pages in a Mooncake store shared by every instance attached to the same master.

    Raises :class:`StorageConfigError` (bad config, unsupported layout) or :class:`StorageError`
    (master/metadata server unreachable, ``setup`` failed, Mooncake not importable) at construction.
    """

    supports_v1 = True

    def __init__(self, storage_config: HiCacheStorageConfig) -> None:
        super().__init__(storage_config)
        if storage_config.layout not in SUPPORTED_LAYOUTS:
            raise StorageConfigError(
                f"layout: the mooncake backend needs host layout page_first or page_first_direct, "
                f"got {storage_config.layout!r}"
            )
        self.config = MooncakeConfig.from_storage_config(storage_config)
        self._check_servers()
        self._store = mooncake_clients.acquire(self.config)
        tag = self.config.extra_backend_tag
        self._prefix = f"{tag}_" if tag else ""
        self._registered_ptr: int | None = None
        self._headers: torch.Tensor | None = None  # (host pages, HEADER_BYTES) uint8, registered
        self._reported: set[str] = set()
        self._closed = False
        self._backoff = _Backoff(lambda: _master_problem(*self.config.master_host_port) is None)

    @property
    def store(self):
        """The ``MooncakeDistributedStore`` client this backend shares (``mooncake_clients``): benchmarks
        and tests write through it directly, without the backend's keys prefix or page headers."""
        return self._store

    def _check_servers(self) -> None:
        cfg = self.config
        reason = _master_problem(*cfg.master_host_port)
        if reason is not None:
            raise StorageError(f"Mooncake master {cfg.master_server_address} is unreachable: {reason}")
        if cfg.metadata_server != P2P_HANDSHAKE and re.match(r"https?://", cfg.metadata_server):
            reason = _http_problem(cfg.metadata_server)
            if reason is not None:
                raise StorageError(f"Mooncake metadata server {cfg.metadata_server} is unreachable: {reason}")

    # -- host pool -------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Register the host pool's ``kv_buffer`` with the transfer engine for zero-copy transfers."""
        if mem_pool_host.layout not in SUPPORTED_LAYOUTS:
            raise StorageConfigError(
                f"layout: the mooncake backend needs host layout page_first or page_first_direct, "
                f"got {mem_pool_host.layout!r}"
            )
        self._unregister()
        buffer = mem_pool_host.kv_buffer
        ptr, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise StorageError(f"Mooncake register_buffer failed (rc={rc}) for {nbytes} bytes of host pool")
        self._registered_ptr = ptr
        headers = torch.zeros((mem_pool_host.page_num, HEADER_BYTES), dtype=torch.uint8)
        rc = self._store.register_buffer(headers.data_ptr(), headers.numel())
        if rc != 0:
            self._unregister()
            raise StorageError(f"Mooncake register_buffer failed (rc={rc}) for the page headers")
        self._headers = headers
        super().register_mem_pool_host(mem_pool_host)

    def _unregister(self) -> None:
        if self._registered_ptr is not None:
            self._store.unregister_buffer(self._registered_ptr)
            self._registered_ptr = None
        if self._headers is not None:
            self._store.unregister_buffer(self._headers.data_ptr())
            self._headers = None

    def _views(self, slot: int) -> list[memoryview]:
        assert self.mem_pool_host is not None, "set before any page I/O (_first_slots raised otherwise)"
        return [
            memoryview(v.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy declares it for 3.12+ only
            for v in self.mem_pool_host.get_page_buffer_views(slot)
        ]

    def _identity(self, key: str) -> PageIdentity:
        cfg = self.storage_config
        return PageIdentity(key, cfg.kv_dtype, cfg.layout, cfg.page_size)

    def _buffers(self, keys: Sequence[str], slots: Sequence[int], write: bool):
        """Per page: pointers and sizes of [header row, K plane, V plane]; for a write the header row is
        filled with the page's identity and checksum first."""
        ptrs, sizes = [], []
        assert self.mem_pool_host is not None and self._headers is not None, "set with the host pool"
        for key, slot in zip(keys, slots, strict=True):
            views = self.mem_pool_host.get_page_buffer_views(slot)
            row = self._headers[slot // self.storage_config.page_size]
            if write:
                payload = self._views(slot)
                header = page_file.pack_header(
                    self._identity(key),
                    sum(v.nbytes for v in payload),
                    page_file.checksum(payload),
                    HEADER_BYTES,
                )
                row.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
            ptrs.append([row.data_ptr(), *(v.data_ptr() for v in views)])
            sizes.append([HEADER_BYTES, *(v.numel() * v.element_size() for v in views)])
        return ptrs, sizes

    def _verified(self, key: str, slot: int) -> bool:
        """Whether the page just read into ``slot`` carries ``key``'s header and a matching checksum; a bad
        page is counted, its slots zeroed, logged once per key and removed from the store."""
        payload = self._views(slot)
        assert self._headers is not None, "registered with the host pool, before any read"
        row = self._headers[slot // self.storage_config.page_size].numpy()
        try:
            nbytes, checksum = page_file.check_identity(memoryview(row), self._identity(key))  # type: ignore[arg-type]  # ndarray has the buffer protocol
            if nbytes != sum(v.nbytes for v in payload):
                raise PageFileError(f"header nbytes {nbytes} != expected {sum(v.nbytes for v in payload)}")
            if page_file.checksum(payload) != checksum:
                raise PageFileError("checksum mismatch")
        except PageFileError as exc:
            for view in payload:
                view[:] = bytes(view.nbytes)
            self._count(corrupt_pages=1)
            if key not in self._reported:
                self._reported.add(key)
                logger.warning("Mooncake page %s treated as a miss: %s", key, exc)
            self._store.remove(self._prefix + key, True)
            return False
        return True

    # -- failure accounting ----------------------------------------------------------------------------
    def _failed(self, what: str, code: int) -> None:
        """Log a failed store call; an RPC failure (master gone) starts the back-off window."""
        if code == RPC_FAIL:
            self._backoff.failed()
        else:
            self._backoff.succeeded()
        logger.warning(
            "Mooncake %s failed (rc=%s, master %s)%s",
            what,
            code,
            self.config.master_server_address,
            "; L3 calls paused" if code == RPC_FAIL else "",
        )

    def _available(self, pages: int) -> bool:
        if self._closed:
            raise StorageError("Mooncake backend is closed")
        if self._backoff.allow():
            return True
        self._count(errors=max(1, pages))
        return False

    # -- v1 zero-copy path -----------------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading count of keys present in the store; 0 (and a counted error) when the store is down."""
        if not keys or not self._available(1):
            return 0
        results = self._store.batch_is_exist([self._prefix + k for k in keys])
        count = 0
        while count < len(results) and results[count] == 1:
            count += 1
        if count < len(results) and results[count] < 0:
            self._count(errors=1)
            self._failed("exists", results[count])
        else:
            self._backoff.succeeded()
        return count

    def batch_get_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read each page straight into its host slots; a missing or wrong-sized object is a miss."""
        slots = self._first_slots(keys, host_indices)
        if not keys:
            return []
        if not self._available(len(keys)):
            self._count(pages_missed=len(keys))
            return [False] * len(keys)
        ptrs, sizes = self._buffers(keys, slots, write=False)
        codes = self._store.batch_get_into_multi_buffers([self._prefix + k for k in keys], ptrs, sizes)
        page_bytes = [sum(s) for s in sizes]
        results = [code == want for code, want in zip(codes, page_bytes, strict=True)]
        results = [ok and self._verified(k, s) for ok, k, s in zip(results, keys, slots, strict=True)]
        failed = [c for c in codes if c < 0 and c != OBJECT_NOT_FOUND]
        wrong_size = sum(1 for c, want in zip(codes, page_bytes, strict=True) if 0 <= c != want)
        hits = sum(results)
        self._count(
            pages_read=hits,
            bytes_read=sum(w - HEADER_BYTES for ok, w in zip(results, page_bytes, strict=True) if ok),
            pages_missed=len(keys) - hits,
            corrupt_pages=wrong_size,
            errors=len(failed),
        )
        if failed:
            self._failed("get", failed[0])
        else:
            self._backoff.succeeded()
        return results

    def batch_set_v1(
        self,
        keys: Sequence[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write each page straight from its host slots; pages already stored are skipped (True)."""
        slots = self._first_slots(keys, host_indices)
        if not keys:
            return []
        if not self._available(len(keys)):
            return [False] * len(keys)
        names = [self._prefix + k for k in keys]
        present = self._store.batch_is_exist(names)
        if any(code < 0 for code in present):
            self._count(errors=len(keys))
            self._failed("exists", min(present))
            return [False] * len(keys)
        todo = [i for i, code in enumerate(present) if code != 1]
        results = [True] * len(keys)
        if todo:
            ptrs, sizes = self._buffers([keys[i] for i in todo], [slots[i] for i in todo], write=True)
            codes = self._store.batch_put_from_multi_buffers([names[i] for i in todo], ptrs, sizes)
            for i, code, size in zip(todo, codes, sizes, strict=True):
                results[i] = code == 0
                if code == 0:
                    self._count(pages_written=1, bytes_written=sum(size) - HEADER_BYTES)
            failed = [c for c in codes if c != 0]
            if failed:
                self._count(errors=len(failed))
                self._failed("put", failed[0])
        self._count(pages_skipped=len(keys) - len(todo))
        if all(results):
            self._backoff.succeeded()
        return results

    # -- generic path (flat page copies through the store's local buffer) -----------------------------
    def get(
        self, key: str, target_location: torch.Tensor | None = None, target_sizes=None
    ) -> torch.Tensor | None:
        """The page under ``key`` as a flat ``kv_dtype`` tensor (copied into ``target_location`` if given)."""
        if not self._available(1):
            self._count(pages_missed=1)
            return None
        data = self._store.get(self._prefix + key)
        dtype = getattr(torch, self.storage_config.kv_dtype)
        want = None if target_location is None else target_location.numel() * target_location.element_size()
        payload = memoryview(data)[HEADER_BYTES:] if data else memoryview(b"")
        if not payload or (want is not None and len(payload) != want) or len(payload) % dtype.itemsize:
            self._count(pages_missed=1)
            return None
        try:
            nbytes, checksum = page_file.check_identity(memoryview(data)[:HEADER_BYTES], self._identity(key))
            if nbytes != len(payload) or page_file.checksum([payload]) != checksum:
                raise PageFileError("payload size or checksum mismatch")
        except PageFileError as exc:
            self._count(pages_missed=1, corrupt_pages=1)
            logger.warning("Mooncake page %s treated as a miss: %s", key, exc)
            return None
        page = torch.frombuffer(bytearray(payload), dtype=dtype)
        self._count(pages_read=1, bytes_read=len(payload))
        if target_location is None:
            return page
        target_location.view(-1).copy_(page)
        return target_location

    def set(
        self, key: str, value: torch.Tensor | None = None, target_location=None, target_sizes=None
    ) -> bool:
        """Store the flat page tensor ``value``; True if stored or already present."""
        if value is None:
            raise ValueError("set() needs the page tensor in value")
        if self.exists(key):
            self._count(pages_skipped=1)
            return True
        if not self._available(1):
            return False
        data = memoryview(value.contiguous().view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray has the buffer protocol; numpy declares it for 3.12+ only
        header = page_file.pack_header(
            self._identity(key), data.nbytes, page_file.checksum([data]), HEADER_BYTES
        )
        rc = self._store.put(self._prefix + key, header + bytes(data))
        if rc != 0:
            self._count(errors=1)
            self._failed("put", rc)
            return False
        self._count(pages_written=1, bytes_written=data.nbytes)
        return True

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- housekeeping ----------------------------------------------------------------------------------
    def clear(self) -> None:
        """Remove stored pages: those under ``extra_backend_tag`` if set, else every object in the store.

        Forced (Mooncake otherwise keeps objects under a read lease), so call it only while no instance
        reads from the store, as the idle-gated admin endpoint does. Raises :class:`StorageError` when
        the store refuses.
        """
        if self._prefix:
            rc = self._store.remove_by_regex(f"^{re.escape(self._prefix)}", True)
        else:
            rc = self._store.remove_all(True)
        if rc < 0:
            raise StorageError(
                f"Mooncake clear failed (rc={rc}) on master {self.config.master_server_address}"
            )

    def close(self) -> None:
        """Unregister the host pool and hand the client back for reuse, so the pages in its segment
        stay (detach keeps L3 data); a client whose master is gone is closed instead. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._unregister()
        if self._backoff.paused:
            mooncake_clients.close_client(self._store, timeout=0.5)
        else:
            mooncake_clients.release(self.config, self._store)
        super().close()
