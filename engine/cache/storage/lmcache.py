"""The ``lmcache`` L3 backend: pages kept by a running LMCache server (``lmcache_server <host> <port> cpu``,
the store behind LMCache's ``lm://host:port`` remote URL), spoken to by KVFleet's own client.

LMCache cannot be imported beside the project's pins (its requirements pin numpy, protobuf, transformers and
CUDA packages), so its server runs from an environment of its own (``scripts/lmcache_env.sh``) and this
module speaks the server's TCP protocol itself (LMCache 0.5.6, ``lmcache.v1.protocol``), which is small:

* a request is 9 native ``int32`` (command, length, memory format, dtype code, location code, a 4-d shape)
  then a 150-byte key, space-padded; the server parses the key as LMCache's ``CacheEngineKey``
  (``model@world_size@worker_id@chunk_hash_hex@dtype``) and closes the connection when it cannot;
* ``PUT`` is followed by ``length`` payload bytes and has no reply; ``GET`` is answered by 9 ``int32``
  (code 200 or 400, length, format, dtype, shape, location) and, on 200, ``length`` bytes; ``EXIST`` and
  ``HEALTH`` by the 9 ``int32`` alone. Commands on one connection are handled in order, one at a time.

How KVFleet uses it (docs/architecture.md, Decisions):

* a page is one LMCache object of format ``BINARY`` (``uint8``, shape ``[length, 0, 0, 0]``) under the key
  ``kvfleet@1@0@<page key>@uint8``: the 64-hex page key (which already names the namespace: model, KV
  format, layout, page size, rank shard) is the chunk hash, so every rank, TP size sharing a namespace and
  worker addresses a page alike; the payload is the ``file`` backend's header fields (key, dtype, layout,
  page size, payload bytes, xxh3_64, :mod:`engine.cache.storage.page_file`) then the page's bytes in the
  host pool's flat order, sent straight from (and received straight into) the host pool's page views;
* requests are pipelined per connection, up to ``WINDOW`` at a time (``EXIST`` and ``GET`` replies are read
  after the window's requests are sent); a write first asks ``EXIST`` for the window (stored pages are kept
  and counted as skipped), then sends its ``PUT`` s and one ``HEALTH``, whose reply says the server has
  stored every ``PUT`` before it (``PUT`` itself is never acknowledged);
* a read whose header or checksum does not match is a miss, counted in ``corrupt_pages``, its host slots
  zeroed. The protocol has no delete, so the key is remembered as bad in this process: existence stops
  there and the next write of that key replaces the object instead of keeping it;
* a connection error, timeout (``lmcache_timeout_s``) or reply out of protocol fails the call's remaining
  pages and counts once in ``errors`` (the circuit breaker's input); that connection is dropped, the next
  call opens another. Misses (code 400) are not errors;
* the server keeps objects in memory without eviction (LMCache 0.5.6's ``cpu`` store has no evictor):
  size it for the prefixes it is to hold, or restart it.

Configuration (extra config, validated before any connection, :class:`StorageConfigError` naming the key):
``lmcache_url`` (``lm://host:port`` as LMCache's ``remote_url``, or ``host:port``; else the environment's
``LMCACHE_REMOTE_URL``), ``lmcache_timeout_s`` (seconds per socket operation, default 10). The server must
answer ``HEALTH`` when the backend is built, else the attach fails naming ``lmcache_url``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import string
import struct
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from engine.cache.storage import page_file
from engine.cache.storage.base import HiCacheStorageConfig, HiCacheStorageExtraInfo, StorageConfigError
from engine.cache.storage.byte_pages import BytePageStorage, Views
from engine.cache.storage.extra_keys import check_lmcache_keys, lmcache_host_port, lmcache_timeout
from engine.cache.storage.page_file import PageFileError, PageIdentity

logger = logging.getLogger(__name__)

FLAG = "--hicache-storage-backend lmcache"
URL_KEY = "lmcache_url"
URL_ENV = "LMCACHE_REMOTE_URL"
TIMEOUT_KEY = "lmcache_timeout_s"
DEFAULT_TIMEOUT_S = 10.0
WINDOW = 64  # requests in flight per connection: 64 x 186 bytes fits any socket buffer, so no deadlock
HEADER_BYTES = page_file.HEADER.size  # the page file header's fields, before the page bytes

# LMCache 0.5.6's wire protocol (lmcache.v1.protocol), little-endian as on the hosts it runs on
PUT, GET, EXIST, HEALTH = 1, 2, 3, 5  # ClientCommand
SUCCESS = 200  # ServerReturnCode (400: not found)
KEY_BYTES = 150  # MAX_KEY_LENGTH
REQUEST = struct.Struct(f"<9i{KEY_BYTES}s")  # ClientMetaMessage
REPLY = struct.Struct("<9i")  # ServerMetaMessage
FORMAT_BINARY = 4  # MemoryFormat.BINARY
DTYPE_UINT8 = 6  # DTYPE_TO_INT[torch.uint8]
PROBE_KEY = "0" * 64  # a key for HEALTH, which the server parses like any other
QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux


def parse_url(value: object, key: str = URL_KEY) -> tuple[str, int]:
    """(host, port) of ``lm://host:port`` or ``host:port``; :class:`StorageConfigError` naming ``key`` (the
    check the flag parser runs, ``extra_keys.lmcache_host_port``)."""
    try:
        return lmcache_host_port(value, key)
    except ValueError as exc:
        raise StorageConfigError(str(exc)) from None


def resolve_config(extra: dict, environ: dict | None = None) -> tuple[str, int, float]:
    """(host, port, timeout seconds) from the extra config (``lmcache_url``, ``lmcache_timeout_s``) and
    ``$LMCACHE_REMOTE_URL``. Raises :class:`StorageConfigError` naming the key: unknown, no URL, a URL that
    is not ``lm://host:port``, a timeout that is not a number > 0."""
    env = os.environ if environ is None else environ
    try:
        check_lmcache_keys(extra)  # the check the flag parser runs (extra_keys.py)
    except ValueError as exc:
        raise StorageConfigError(str(exc)) from None
    if URL_KEY in extra:
        host, port = parse_url(extra[URL_KEY])
    elif env.get(URL_ENV):
        host, port = parse_url(env[URL_ENV], URL_ENV)
    else:
        raise StorageConfigError(f"{URL_KEY}: no LMCache server named (lm://host:port; or set {URL_ENV})")
    try:
        timeout = lmcache_timeout(extra.get(TIMEOUT_KEY, DEFAULT_TIMEOUT_S))
    except ValueError as exc:
        raise StorageConfigError(str(exc)) from None
    return host, port, timeout


def wire_key(key: str) -> bytes:
    """The 150-byte request key naming page ``key`` as an LMCache ``CacheEngineKey``: a page key (64 hex) is
    the chunk hash itself; any other key (the auto-detach probe's) its sha256, since the server drops the
    connection on a chunk hash that is not hex."""
    if not (0 < len(key) <= 64 and all(c in string.hexdigits for c in key)):
        key = hashlib.sha256(key.encode()).hexdigest()
    return f"kvfleet@1@0@{key}@uint8".encode().ljust(KEY_BYTES)


def request(command: int, key: str, length: int = 0) -> bytes:
    """One request header: ``command`` on ``key`` with ``length`` payload bytes following (PUT)."""
    return REQUEST.pack(command, length, FORMAT_BINARY, DTYPE_UINT8, 0, length, 0, 0, 0, wire_key(key))


class ProtocolError(ConnectionError):
    """The server closed the connection or answered outside the protocol."""


def send_all(sock: socket.socket, buffers: Sequence) -> None:
    """Send every byte of ``buffers`` in order (``sendmsg``, gathering them; partial sends resumed)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views[:512])
        while sent:
            if sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            else:
                views[0], sent = views[0][sent:], 0


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; :class:`ProtocolError` when the server closes first."""
    view = view.cast("B")
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise ProtocolError("the LMCache server closed the connection")
        view = view[got:]


def recv_exact(sock: socket.socket, nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    recv_into(sock, memoryview(buf))
    return buf


def discard(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (a reply this reader will not use)."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
    while nbytes:
        part = min(nbytes, scratch.nbytes)
        recv_into(sock, scratch[:part])
        nbytes -= part


def read_reply(sock: socket.socket) -> tuple[int, int]:
    """(code, payload length) of the next reply. ACKs go out at once while replies are awaited: the server's
    sockets keep Nagle's algorithm, which would hold each window's later replies until the first is ACKed,
    and a delayed ACK waits up to 40 ms (Linux re-enters delayed-ACK mode by itself, hence every reply)."""
    if QUICKACK is not None:
        sock.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)
    code, length, *_ = REPLY.unpack(recv_exact(sock, REPLY.size))
    if code not in (SUCCESS, 400) or length < 0:
        raise ProtocolError(f"reply out of protocol: code {code}, length {length}")
    return code, length


class Connections:
    """Idle connections to one server, lent one per call (the backup and prefetch threads each hold one)."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @contextlib.contextmanager
    def lend(self) -> Iterator[socket.socket]:
        """A connection for the block; dropped when the block raises, kept for reuse otherwise."""
        with self._lock:
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            yield sock
        except BaseException:
            sock.close()
            raise
        with self._lock:
            if not self._closed:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for sock in idle:
            sock.close()


def _windows(n: int) -> Iterator[slice]:
    for start in range(0, n, WINDOW):
        yield slice(start, min(n, start + WINDOW))


class HiCacheLMCache(BytePageStorage):
    """L3 pages in an LMCache server; thread-safe; ``supports_v1`` (pages sent from and received into their
    host-pool slots without a copy through Python).

    Raises :class:`StorageConfigError` at construction for a bad extra config (naming the key) or a server
    that does not answer ``HEALTH`` (naming ``lmcache_url``, or ``LMCACHE_REMOTE_URL`` when the URL came from
    there, and the address)."""

    def __init__(self, storage_config: HiCacheStorageConfig) -> None:
        super().__init__(storage_config)
        host, port, timeout = resolve_config(storage_config.extra_config)
        self.connections = Connections(host, port, timeout)
        named_by = URL_KEY if URL_KEY in storage_config.extra_config else URL_ENV
        self._bad: set[str] = set()  # keys read back damaged: absent until written again
        self._bad_lock = threading.Lock()
        try:
            self.health()
        except OSError as exc:
            self.connections.close()
            raise StorageConfigError(
                f"{named_by}: no LMCache server answers at lm://{self.connections.address} ({exc}); start "
                "one with `lmcache_server <host> <port> cpu` (scripts/lmcache_env.sh builds its environment)"
            ) from exc

    def health(self) -> None:
        """One ``HEALTH`` round trip; raises ``OSError`` (incl. :class:`ProtocolError`) when it fails."""
        with self.connections.lend() as sock:
            send_all(sock, [request(HEALTH, PROBE_KEY)])
            if read_reply(sock)[0] != SUCCESS:
                raise ProtocolError("HEALTH was not answered with success")

    def close(self) -> None:
        """Close every idle connection (calls in flight close theirs when they end)."""
        self.connections.close()
        super().close()

    def _identity(self, key: str) -> PageIdentity:
        cfg = self.storage_config
        return PageIdentity(key, cfg.kv_dtype, cfg.layout, cfg.page_size)

    def _is_bad(self, key: str) -> bool:
        with self._bad_lock:
            return key in self._bad

    def _set_bad(self, key: str, bad: bool) -> None:
        with self._bad_lock:
            if bad:
                self._bad.add(key)
            else:
                self._bad.discard(key)

    def _failed(self, what: str, pages: int, exc: Exception) -> None:
        self._count(errors=1)
        logger.warning("L3 lmcache (lm://%s): %s of %d pages failed: %s", self.connections.address, what,
                       pages, exc)  # fmt: skip

    # -- protocol steps (one window of keys on one connection) -----------------------------------------
    def _exist(self, sock: socket.socket, keys: Sequence[str]) -> list[bool]:
        send_all(sock, [request(EXIST, key) for key in keys])
        return [read_reply(sock)[0] == SUCCESS and not self._is_bad(key) for key in keys]

    def _put(self, sock: socket.socket, keys: Sequence[str], pages: Sequence[Views]) -> None:
        """PUT each page (header fields, then its views), then HEALTH: its reply means all are stored."""
        for key, views in zip(keys, pages, strict=True):
            nbytes = sum(v.nbytes for v in views)
            header = page_file.pack_header(
                self._identity(key), nbytes, page_file.checksum(views), HEADER_BYTES
            )
            send_all(sock, [request(PUT, key, HEADER_BYTES + nbytes), header, *views])
        send_all(sock, [request(HEALTH, PROBE_KEY)])
        if read_reply(sock)[0] != SUCCESS:
            raise ProtocolError("HEALTH after PUT was not answered with success")

    def _get(self, sock: socket.socket, keys: Sequence[str], pages: Sequence[Views], out: list[bool]) -> None:
        """GET each page into its views, appending one result per page to ``out`` as it is received."""
        send_all(sock, [request(GET, key) for key in keys])
        for key, views in zip(keys, pages, strict=True):
            out.append(self._receive(sock, key, views))

    def _receive(self, sock: socket.socket, key: str, views: Views) -> bool:
        """Read one GET reply into ``views``; False for a miss or a rejected page (views zeroed)."""
        code, length = read_reply(sock)
        if code != SUCCESS:
            self._count(pages_missed=1)
            return False
        want = sum(v.nbytes for v in views)
        if length != HEADER_BYTES + want:  # another KV geometry, or not ours: not read into the pool
            discard(sock, length)
            self._reject(key, f"object holds {length} bytes, expected {HEADER_BYTES + want}", views)
            return False
        header = recv_exact(sock, HEADER_BYTES)
        for view in views:
            recv_into(sock, view)
        try:
            nbytes, checksum = page_file.check_identity(header, self._identity(key))
            if nbytes != want:
                raise PageFileError(f"header nbytes {nbytes} != expected {want}")
            if page_file.checksum(views) != checksum:
                raise PageFileError("checksum mismatch")
        except PageFileError as exc:
            self._reject(key, str(exc), views)
            return False
        self._set_bad(key, False)
        self._count(pages_read=1, bytes_read=want)
        return True

    def _reject(self, key: str, reason: str, views: Views) -> None:
        for view in views:
            np.asarray(view)[:] = 0  # no foreign bytes are left in the target
        self._set_bad(key, True)
        self._count(corrupt_pages=1, pages_missed=1)
        logger.warning("L3 lmcache page %s treated as a miss: %s", key, reason)

    # -- core read / write ------------------------------------------------------------------------------
    def _write(self, keys: Sequence[str], pages: Sequence[Views]) -> list[bool]:
        """Store each page under its key; pages already stored are kept (True)."""
        results: list[bool] = []
        for part in _windows(len(keys)):
            part_keys, part_pages = keys[part], pages[part]
            have = [False] * len(part_keys)
            try:
                with self.connections.lend() as sock:
                    have = self._exist(sock, part_keys)
                    todo = [i for i, stored in enumerate(have) if not stored]
                    self._put(sock, [part_keys[i] for i in todo], [part_pages[i] for i in todo])
            except OSError as exc:
                self._failed("write", have.count(False), exc)
                results += have
                continue
            for i in todo:
                self._set_bad(part_keys[i], False)
            nbytes = sum(v.nbytes for i in todo for v in part_pages[i])
            self._count(pages_written=len(todo), pages_skipped=len(have) - len(todo), bytes_written=nbytes)
            results += [True] * len(part_keys)
        return results

    def _read(self, keys: Sequence[str], pages: Sequence[Views]) -> list[bool]:
        """Fill each page's views from the server; per key True, or False for a miss, a rejected page (its
        views zeroed) or a failed call (the pages it did not finish zeroed)."""
        results: list[bool] = []
        for part in _windows(len(keys)):
            try:
                with self.connections.lend() as sock:
                    self._get(sock, keys[part], pages[part], results)
            except OSError as exc:
                missing = part.stop - len(results)
                for views in pages[len(results) : part.stop]:
                    for view in views:
                        np.asarray(view)[:] = 0
                self._failed("read", missing, exc)
                self._count(pages_missed=missing)
                results += [False] * missing
        return results

    def batch_exists(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading keys stored (``EXIST``, pipelined; a key read back damaged here counts as absent); a
        failed call ends the count where it failed (counted in ``errors``)."""
        count = 0
        for part in _windows(len(keys)):
            try:
                with self.connections.lend() as sock:
                    found = self._exist(sock, keys[part])
            except OSError as exc:
                self._failed("exists", part.stop - part.start, exc)
                return count
            lead = found.index(False) if False in found else len(found)
            count += lead
            if lead < len(found):
                return count
        return count
