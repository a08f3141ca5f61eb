"""The multimodal global cache (``--enable-mm-global-cache`` on an ``--encoder-only`` worker): image
embeddings kept in a shared Mooncake store, so an image one encoder ran is not run again by any encoder of
the same vision tower.

Keys are ``kvfleet-mm/<vision digest>/<image digest>``: the vision digest covers the tower, projector and
processor settings (``LlavaSpec.digest``), the image digest the processed pixels, so an embedding is never
found under another tower or other preprocessing. A value is a 4-byte big-endian header length, a JSON
header (``shape``, ``dtype``: always float32, ``sha256`` of the payload) and the embedding's bytes; a value
whose header or checksum does not match is a miss, counted in ``corrupt``, never used.

Lookups run before encoding and wait at most ``GET_TIMEOUT_S``; writes of what was encoded run in the
background (a bounded queue; past it a write is dropped and counted). Any store error, or a lookup past its
timeout, is a miss, counted in ``errors``, and the cache is skipped for ``BACKOFF_S`` so a dead or hung
master costs one request at most one timeout, never a failure. The store is Mooncake's client as the L3
backend mounts it (``MOONCAKE_MASTER`` and the other variables, or ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import struct
import threading
import time

import torch

from engine.cache.storage import mooncake_clients
from engine.cache.storage.mooncake_config import MooncakeConfig

logger = logging.getLogger(__name__)

GET_TIMEOUT_S = 2.0
BACKOFF_S = 30.0
MAX_PENDING_WRITES = 64
PREFIX = "kvfleet-mm"


def pack(embeds: torch.Tensor) -> bytes:
    """``embeds`` (any shape, float32 after conversion) as a stored value: header length, header, bytes."""
    payload = embeds.detach().float().contiguous().numpy().tobytes()
    header = json.dumps(
        {"shape": list(embeds.shape), "dtype": "float32", "sha256": hashlib.sha256(payload).hexdigest()}
    ).encode()
    return struct.pack(">I", len(header)) + header + payload


def unpack(data: bytes) -> torch.Tensor:
    """The float32 tensor in a stored value; raises ``ValueError`` when its header or checksum is wrong."""
    if len(data) < 4:
        raise ValueError("value shorter than its header length")
    (n,) = struct.unpack(">I", data[:4])
    try:
        header = json.loads(data[4 : 4 + n])
        shape = [int(d) for d in header["shape"]]
        digest = header["sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"bad header ({exc})") from None
    payload = data[4 + n :]
    if header.get("dtype") != "float32" or len(payload) != 4 * int(torch.tensor(shape).prod().item()):
        raise ValueError("payload size does not match the header's shape")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise ValueError("checksum mismatch")
    return torch.frombuffer(bytearray(payload), dtype=torch.float32).reshape(shape)


class MMGlobalCache:
    """Embeddings by image digest in a shared store. ``get`` / ``put`` never raise; counters: ``hits``,
    ``misses``, ``writes``, ``errors``, ``corrupt``, ``dropped_writes``. Thread-safe."""

    def __init__(self, store, namespace: str) -> None:
        """``store``: a Mooncake client (``put(key, bytes) -> rc``, ``get(key) -> bytes``);
        ``namespace``: the vision digest."""
        self._store, self._namespace = store, namespace
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mm-global-get")
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mm-global-put")
        self._lock = threading.Condition()
        self._pending = 0
        self._skip_until = 0.0
        self.hits = self.misses = self.writes = self.errors = self.corrupt = self.dropped_writes = 0

    @classmethod
    def connect(cls, namespace: str) -> tuple[MMGlobalCache, MooncakeConfig]:
        """Mount a Mooncake client from the environment; raises ``StorageConfigError`` (nothing
        configured) or ``StorageError`` (the master does not answer) naming the master."""
        cfg = MooncakeConfig.resolve({})
        return cls(mooncake_clients.acquire(cfg), namespace), cfg

    def key(self, digest: str) -> str:
        return f"{PREFIX}/{self._namespace}/{digest}"

    def _failed(self, what: str, exc: object) -> None:
        with self._lock:
            self.errors += 1
            self._skip_until = time.monotonic() + BACKOFF_S
        logger.warning("mm global cache %s failed (%s); skipped for %.0f s", what, exc, BACKOFF_S)

    def _skipping(self) -> bool:
        return time.monotonic() < self._skip_until

    def get(self, digest: str) -> torch.Tensor | None:
        """The embedding stored for ``digest``, or None (absent, corrupt, store error or timeout)."""
        if self._skipping():
            with self._lock:
                self.misses += 1
            return None
        try:
            data = self._reader.submit(self._store.get, self.key(digest)).result(GET_TIMEOUT_S)
        except Exception as exc:  # a store error or no answer in time is a miss, never a failed request
            self._failed("lookup", exc if str(exc) else f"no answer within {GET_TIMEOUT_S} s")
            with self._lock:
                self.misses += 1
            return None
        value = None
        if data:
            try:
                value = unpack(bytes(data))
            except ValueError as exc:
                logger.warning("mm global cache entry %s treated as a miss: %s", digest, exc)
                with self._lock:
                    self.corrupt += 1
        with self._lock:
            if value is None:
                self.misses += 1
            else:
                self.hits += 1
        return value

    def put(self, digest: str, embeds: torch.Tensor) -> None:
        """Store ``embeds`` for ``digest`` in the background (dropped and counted past the queue bound or
        while the store is skipped)."""
        with self._lock:
            if self._pending >= MAX_PENDING_WRITES or self._skipping():
                self.dropped_writes += 1
                return
            self._pending += 1
        value = pack(embeds)
        self._writer.submit(self._write, digest, value)

    def _write(self, digest: str, value: bytes) -> None:
        try:
            rc = self._store.put(self.key(digest), value)
            if rc != 0:
                raise RuntimeError(f"put returned {rc}")
            with self._lock:
                self.writes += 1
        except Exception as exc:
            self._failed("write", exc)
        finally:
            with self._lock:
                self._pending -= 1
                self._lock.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queued writes are done (True) or ``timeout`` passes (False)."""
        with self._lock:
            return self._lock.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)
        self._writer.shutdown(wait=False, cancel_futures=True)
