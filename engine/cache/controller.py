"""HiCacheController: the cache's I/O queues and threads (SGLang ``cache_controller.py``,
docs/upstream.md H2-H3).

Four background threads, each fed by a queue and answering through an ack deque that the scheduler
thread drains in FIFO order:

* write (L1 -> L2 backup copies), acked per op;
* load (L2 -> L1), one merged op per forward pass with a ``threading.Event`` per layer so attention on
  layer ``i`` can start while later layers are still copying (on CUDA the copies run on the io backend's
  load stream and the compute stream waits on layer ``i``'s CUDA event only). Where the backend copies on
  the calling thread (``IOBackend.copy_on_wait``: CPU), layers are handed out in order to whichever thread
  asks first: a ``wait_layer(i)`` that finds layer ``i`` not yet started copies the next layers up to ``i``
  itself instead of sleeping (no wake-up of the load thread in the way, and two threads on a long load);
* backup (L2 -> L3, started by ``attach_storage``), 128-page batches, stops at the first failed batch;
* prefetch (L3 -> L2): hit query (``batch_exists``, MIN over ranks), then reads into reserved host slots.

Background threads never touch the tree or free pool slots: frees go through the release queue. The
scheduler thread reads every acknowledgement as a typed event (:meth:`HiCacheController.copy_events`,
:meth:`HiCacheController.storage_events`); the numbers of acks taken per iteration are reduced (MIN) over
ranks so every rank applies the same mutations in the same order.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.cache.host_pool import HostKVPool
from engine.cache.io_backends import IOBackend
from engine.cache.keys import page_hashes, salted_namespace
from engine.cache.prefetch_operation import PrefetchOperation
from engine.cache.ranks import Reduce
from engine.cache.stats import CacheStats
from engine.cache.storage.base import HiCacheStorage, HiCacheStorageExtraInfo
from engine.cache.storage.health import StorageHealth

logger = logging.getLogger(__name__)

STORAGE_BATCH_SIZE = 128  # pages per backend call, as upstream
_JOIN_TIMEOUT = 10.0


@dataclass
class CopyOperation:
    """An L1 <-> L2 copy; ``payload`` (the ids of every op merged into it) comes back with the ack."""

    device_indices: torch.Tensor
    host_indices: torch.Tensor
    payload: list
    num_layers: int
    after: torch.cuda.Event | None = None  # loads: the compute-stream mark to wait for (compute_mark)
    done: threading.Event = field(default_factory=threading.Event)
    layer_done: list = field(default_factory=list)
    layer_ready: list[torch.cuda.Event | None] = field(default_factory=list)  # loads: load_layer's, per layer
    # loads: the io backend's plan (made with the first layer handed out), layers handed out and layers
    # copied so far (under ``claim_lock``; handed out in order), perf_counter seconds at the first hand-out
    # and at the end of the last copy; after a failure the first error and the lowest layer missing (from
    # which on every layer's event is set all the same)
    plan: object = None
    claimed: int = 0
    copied: int = 0
    claim_lock: threading.Lock = field(default_factory=threading.Lock)
    started: float = 0.0
    finished: float = 0.0
    error: Exception | None = None
    failed_layer: int | None = None

    def __post_init__(self) -> None:
        self.layer_done = [threading.Event() for _ in range(self.num_layers)]
        self.layer_ready = [None] * self.num_layers


@dataclass
class BackupOperation:
    """An L2 -> L3 write of one node's pages."""

    host_indices: torch.Tensor
    hash_value: list[str]
    payload: object
    prefix_keys: list[str] | None = None
    completed_tokens: int = 0


@dataclass(frozen=True, slots=True)
class WriteDone:
    """L1 -> L2 copies finished: ``ids`` of every write merged into the acknowledged op."""

    ids: list


@dataclass(frozen=True, slots=True)
class LoadDone:
    """L2 -> L1 copies finished: ``ids`` of every load merged into the acknowledged op."""

    ids: list


@dataclass(frozen=True, slots=True)
class PrefetchRevoked:
    """The hit query of ``op`` found less than the prefetch threshold (its slots come back as a
    :class:`HostSlotsReleased`)."""

    op: PrefetchOperation


@dataclass(frozen=True, slots=True)
class BackupDone:
    """An L2 -> L3 write ended: ``op.payload`` is the node whose host copy it pinned; ``op.completed_tokens``
    reached L3."""

    op: BackupOperation


@dataclass(frozen=True, slots=True)
class HostSlotsReleased:
    """Host slots a prefetch reserved and did not fill, for the scheduler thread to free."""

    slots: torch.Tensor


@dataclass
class StorageProbe:
    """A cost probe's L3 round trip on the prefetch thread (engine/scheduler/costs_probe.py): the filled
    host slots ``source`` (``len(token_ids)`` slots, whole pages) are written to L3 under the chained page
    keys of ``token_ids`` in key space ``salt`` (as an L2 -> L3 backup writes), then read back into the host
    slots ``scratch`` (as many) as one timed prefetch (hit query plus reads), which is observed as a
    ``prefetch`` cost. Both slot sets come back as one :class:`HostSlotsReleased`; ``done`` then gets
    ``(tokens, seconds)`` of the read, or None when the store took or gave back nothing."""

    token_ids: list[int]
    salt: str
    source: torch.Tensor
    scratch: torch.Tensor
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


CacheEvent = WriteDone | LoadDone | PrefetchRevoked | BackupDone | HostSlotsReleased


class _Worker:
    """A daemon thread running ``handle(item)`` for each queued item until a None sentinel."""

    def __init__(self, name: str, handle) -> None:
        self.queue: queue.Queue = queue.Queue()
        self._handle = handle
        self.busy = 0  # items queued or being handled
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item) -> None:
        with self._lock:
            self.busy += 1
        self.queue.put(item)

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            try:
                self._handle(item)
            except Exception:
                logger.exception("cache I/O thread %s failed on an operation", self._thread.name)
            finally:
                with self._lock:
                    self.busy -= 1

    def stop(self) -> bool:
        """Ask the thread to finish its queue and exit; True when it did within the timeout."""
        self.queue.put(None)
        self._thread.join(_JOIN_TIMEOUT)
        return not self._thread.is_alive()


class HiCacheController:
    """Runs copies and storage I/O for one rank. ``reduce`` serves the scheduler thread, ``reduce_io``
    (a separate group) the prefetch thread's hit query."""

    def __init__(
        self, io: IOBackend, host_pool: HostKVPool, stats: CacheStats, reduce: Reduce, reduce_io: Reduce
    ):
        self.io = io
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.num_layers = host_pool.num_layers
        self.stats = stats
        self.reduce = reduce
        self.reduce_io = reduce_io
        self._write_acks: deque[CopyOperation] = deque()
        self._load_acks: deque[CopyOperation] = deque()
        self._load_queue: list[CopyOperation] = []
        self._current_load: CopyOperation | None = None
        self._writer = _Worker("hicache-write", self._run_write)
        self._loader = _Worker("hicache-load", self._run_load)
        # storage side (attach_storage / detach_storage)
        self.backend: HiCacheStorage | None = None
        self.backend_name: str | None = None
        self._detached_backend_errors = 0
        self.namespace: bytes | None = None
        self.health: StorageHealth | None = None  # the attached backend's breaker (kept after a detach)
        self.backup_skip = False
        self.prefetch_threshold = 256
        self._backuper: _Worker | None = None
        self._prefetcher: _Worker | None = None
        self._backups_done: deque[BackupOperation] = deque()
        self._revoked: deque[PrefetchOperation] = deque()
        self._released: deque[torch.Tensor] = deque()

    # -- L1 -> L2 --------------------------------------------------------------------------------------------
    def write(self, device_indices: torch.Tensor, host_indices: torch.Tensor, payload: list) -> None:
        """Queue an L1 -> L2 copy; its ack carries ``payload``."""
        op = CopyOperation(device_indices, host_indices, payload, self.num_layers)
        self._write_acks.append(op)
        self._writer.put(op)

    def _run_write(self, op: CopyOperation) -> None:
        self.io.backup(op.device_indices, op.host_indices)
        self.stats.add(bytes_d2h=len(op.device_indices) * self.io.bytes_per_token)
        op.done.set()

    def _pop_acks(self, acks: deque[CopyOperation]) -> list[list]:
        ready = 0
        for op in acks:
            if not op.done.is_set():
                break
            ready += 1
        ready = self.reduce("min", [ready])[0]
        return [acks.popleft().payload for _ in range(ready)]

    # -- L2 -> L1 --------------------------------------------------------------------------------------------
    def load(self, device_indices: torch.Tensor, host_indices: torch.Tensor, payload: list) -> None:
        """Queue an L2 -> L1 copy; it starts at ``start_loading``."""
        self._load_queue.append(CopyOperation(device_indices, host_indices, payload, self.num_layers))

    def start_loading(self) -> None:
        """Merge the queued loads into one op and start it on the load thread."""
        if not self._load_queue:
            return
        ops, self._load_queue = self._load_queue, []
        merged = CopyOperation(
            torch.cat([o.device_indices for o in ops]),
            torch.cat([o.host_indices for o in ops]),
            [p for o in ops for p in o.payload],
            self.num_layers,
            after=self.io.compute_mark(),
        )
        self._current_load = merged
        self._load_acks.append(merged)
        self._loader.put(merged)

    def _claim(self, op: CopyOperation, upto: int) -> int | None:
        """Hand the calling thread the next layer of load ``op`` to copy when it is at most ``upto`` (the
        first hand-out makes the plan and starts the clock), else None."""
        with op.claim_lock:
            layer = op.claimed
            if layer > upto:
                return None
            if op.plan is None:
                op.started = time.perf_counter()
                op.plan = self.io.prepare_load(op.device_indices, op.host_indices, op.after)
            op.claimed = layer + 1
        return layer

    def _abandon(self, op: CopyOperation, layer: int, exc: Exception) -> None:
        """``layer`` of ``op`` failed with ``exc`` (its copy, or the plan): no further layer is handed out;
        the layers never handed out are marked done (failed), so nobody waits for them."""
        with op.claim_lock:
            if op.error is None:
                op.error = exc
            op.failed_layer = layer if op.failed_layer is None else min(op.failed_layer, layer)
            unclaimed = range(op.claimed, self.num_layers)
            op.claimed = self.num_layers
        for later in unclaimed:
            op.layer_done[later].set()

    def _copy_layers(self, op: CopyOperation, upto: int) -> None:
        """Copy the layers of ``op`` not yet handed out, up to ``upto``, on the calling thread, setting each
        layer's event; the thread that ends the last copy stops the clock. Raises a failed copy's (or
        plan's) error after :meth:`_abandon`."""
        while True:
            first = op.claimed
            try:
                layer = self._claim(op, upto)
            except Exception as exc:  # the plan
                self._abandon(op, first, exc)
                raise
            if layer is None:
                return
            try:
                op.layer_ready[layer] = self.io.load_layer(layer, op.plan)
            except Exception as exc:
                self._abandon(op, layer, exc)
                raise
            finally:
                with op.claim_lock:
                    op.copied += 1
                    if op.copied == self.num_layers:
                        op.finished = time.perf_counter()
                op.layer_done[layer].set()

    def _copy_in(self, op: CopyOperation) -> float:
        """Copy ``op`` L2 -> L1 layer by layer (the layers a ``wait_layer`` took are copied there); the wall
        seconds from the first layer's start until every byte is in L1. Raises the load's first error (its
        own or one that a ``wait_layer`` met)."""
        self._copy_layers(op, self.num_layers - 1)
        for done in op.layer_done:
            done.wait()
        if op.error is not None:
            raise op.error
        if self.io.copy_on_wait:  # synchronous copies: the last one ended the load
            return op.finished - op.started
        for ready in op.layer_ready:  # the ack means the bytes are in L1
            self.io.synchronize(ready)
        return time.perf_counter() - op.started

    def _run_load(self, op: CopyOperation) -> None:
        seconds = self._copy_in(op)
        self.stats.add(bytes_h2d=len(op.device_indices) * self.io.bytes_per_token, load_back_seconds=seconds)
        self.stats.observe("load_back_duration_seconds", seconds)
        self.stats.costs.observe("load_back", len(op.device_indices), seconds)
        op.done.set()

    def probe_load(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> float:
        """A cost probe's load-back: copy ``host_indices`` into ``device_indices`` (scratch slots, no tree
        node) on the calling thread with the load thread's copy routine, observe it as a ``load_back`` cost
        and return its wall seconds. Queues nothing and acknowledges nothing; the load-back byte counters and
        histograms (traffic's) are left alone. Call only with no load queued or running."""
        assert not self._load_queue and not self._load_acks, "the probe runs with no load in flight"
        op = CopyOperation(device_indices, host_indices, [], self.num_layers, after=self.io.compute_mark())
        seconds = self._copy_in(op)
        self.stats.costs.observe("load_back", len(device_indices), seconds)
        return seconds

    def wait_layer(self, layer: int) -> None:
        """Until the latest started load has copied every layer up to ``layer`` (earlier loads finish first):
        on CPU block, copying the layers up to ``layer`` that the load thread has not started yet on this
        thread; on CUDA block only until the copy is issued, then make the compute stream wait for its
        event. Raises the load's first error when a layer up to ``layer`` is missing (its copy or the plan
        failed), or an earlier load's that this thread finished."""
        op = self._current_load
        if op is not None:
            if self.io.copy_on_wait:
                for earlier in list(self._load_acks):  # unacknowledged loads, oldest first, finish first
                    if earlier is op:
                        break
                    self._copy_layers(earlier, self.num_layers - 1)
                    if earlier.copied < self.num_layers:
                        for done in earlier.layer_done:
                            done.wait()
                    if earlier.error is not None:
                        raise earlier.error
                self._copy_layers(op, layer)
            if op.copied < self.num_layers:  # two threads end layers in any order: wait for all up to it
                for done in op.layer_done[: layer + 1]:
                    done.wait()
            if op.failed_layer is not None and op.failed_layer <= layer:
                assert op.error is not None, "a failed layer comes with its error"
                raise op.error
            self.io.wait_loaded(op.layer_ready[layer])

    def copy_events(self) -> list[WriteDone | LoadDone]:
        """Acknowledged writes, then finished loads, each FIFO and as many as every rank has (MIN)."""
        events: list[WriteDone | LoadDone] = [WriteDone(p) for p in self._pop_acks(self._write_acks)]
        events += [LoadDone(p) for p in self._pop_acks(self._load_acks)]
        if not self._load_acks:
            self._current_load = None
        return events

    def storage_events(
        self, reduce: Reduce | None = None
    ) -> list[PrefetchRevoked | BackupDone | HostSlotsReleased]:
        """Revoked prefetches, ended backups, then released host slots, each FIFO and as many as every
        rank has (``reduce``, default the scheduler's: MIN over ranks)."""
        queues = (self._revoked, self._backups_done, self._released)
        counts = (reduce or self.reduce)("min", [len(q) for q in queues])
        events: list[PrefetchRevoked | BackupDone | HostSlotsReleased] = []
        events += [PrefetchRevoked(self._revoked.popleft()) for _ in range(counts[0])]
        events += [BackupDone(self._backups_done.popleft()) for _ in range(counts[1])]
        events += [HostSlotsReleased(self._released.popleft()) for _ in range(counts[2])]
        return events

    def pending_storage_events(self) -> int:
        """Revokes and host-slot releases not yet taken by ``storage_events``."""
        return len(self._revoked) + len(self._released)

    # -- storage attach --------------------------------------------------------------------------------------
    def attach_storage(
        self,
        backend: HiCacheStorage,
        namespace: bytes,
        threshold: int,
        backup_skip: bool,
        name: str,
        health: StorageHealth | None = None,
    ) -> None:
        """Start the backup and prefetch threads for ``backend`` (``name`` labels its I/O histograms);
        every store call goes through the ``health`` breaker (a new default one when None)."""
        self.backend = backend
        self.health = health or StorageHealth()
        self.backend_name = name
        self.namespace = namespace
        self.backup_skip = backup_skip
        self.set_prefetch_threshold(threshold)
        self._backuper = _Worker("hicache-backup", self._run_backup)
        self._prefetcher = _Worker("hicache-prefetch", self._run_prefetch)

    def set_prefetch_threshold(self, threshold: int) -> None:
        self.prefetch_threshold = max(threshold, self.page_size)

    def detach_storage(self) -> HiCacheStorage | None:
        """Stop the storage threads; returns the detached backend (not closed). Raises ``RuntimeError``
        when a thread does not stop (state kept, so a retry is safe)."""
        for worker in (self._backuper, self._prefetcher):
            if worker is not None and not worker.stop():
                raise RuntimeError("detach aborted: a storage I/O thread did not stop")
        backend, self.backend = self.backend, None
        if backend is not None:
            self._detached_backend_errors += backend.get_stats().get("errors", 0)
        self._backuper = self._prefetcher = None
        self.namespace = self.backend_name = None
        return backend

    # -- L2 -> L3 --------------------------------------------------------------------------------------------
    def backup_storage(self, op: BackupOperation) -> None:
        """Queue an L2 -> L3 write; acked through ``backup_acks``."""
        assert self._backuper is not None, "storage I/O runs only while a backend is attached"
        self._backuper.put(op)

    def _run_backup(self, op: BackupOperation) -> None:
        try:
            if not self.backup_skip:
                self._write_pages(op)
        finally:
            self._backups_done.append(op)

    def _guarded(self, what: str, call):
        """``call()`` under the breaker: its result, or None when the breaker refused it or it raised (a
        raise is logged and counted). The outcome (errors the backend counted, latency) is recorded."""
        assert self.backend is not None and self.health is not None, "storage I/O runs only while attached"
        if not self.health.allow():
            return None
        errors = self.backend.get_stats().get("errors", 0)
        began = time.perf_counter()
        try:
            result = call()
        except Exception as exc:
            logger.exception("L3 %s failed", what)
            self.stats.add(storage_errors=1)
            self.health.record(False, time.perf_counter() - began, f"{what}: {exc}")
            return None
        failed = self.backend.get_stats().get("errors", 0) > errors
        self.health.record(not failed, time.perf_counter() - began, f"{what}: the backend counted an error")
        return result

    def _write_pages(self, op: BackupOperation) -> None:
        P = self.page_size
        assert self.health is not None, "storage I/O runs only while a backend is attached"
        if not self.health.admit_backup(len(op.hash_value)):  # ramping up after a store recovery
            self.health.drop_backup(len(op.hash_value))
            return
        info = HiCacheStorageExtraInfo(prefix_keys=op.prefix_keys) if op.prefix_keys is not None else None
        for start in range(0, len(op.hash_value), STORAGE_BATCH_SIZE):
            keys = op.hash_value[start : start + STORAGE_BATCH_SIZE]
            slots = op.host_indices[start * P : (start + len(keys)) * P]
            began = time.perf_counter()

            def write(keys=keys, slots=slots):
                if self.backend.supports_v1:
                    return self.backend.batch_set_v1(keys, slots, info)
                pages = [self.host_pool.get_flat_data_page(int(s)) for s in slots[::P].tolist()]
                return [self.backend.batch_set(keys, pages)] * len(keys)

            results = self._guarded("backup", write)
            if results is None:  # breaker open (dropped, counted) or the call raised
                self.health.drop_backup(len(op.hash_value) - start)
                return
            ok = _leading_true(results)
            op.completed_tokens += ok * P
            self.stats.add(bytes_l3_write=ok * self.host_pool.page_bytes)
            self._observe_batch("backup", len(keys), ok, time.perf_counter() - began)
            if ok < len(keys):
                self.stats.add(storage_errors=1)
                return

    # -- L3 -> L2 --------------------------------------------------------------------------------------------
    def prefetch(self, op: PrefetchOperation) -> None:
        """Queue a prefetch (its host slots are already reserved)."""
        assert self._prefetcher is not None, "storage I/O runs only while a backend is attached"
        self._prefetcher.put(op)

    def probe_storage(self, probe: StorageProbe) -> None:
        """Queue a cost probe's L3 round trip behind the prefetches (it counts as prefetch I/O in flight
        until done, so idle-gated admin changes wait for it)."""
        assert self._prefetcher is not None, "storage I/O runs only while a backend is attached"
        self._prefetcher.put(probe)

    def _run_storage_probe(self, probe: StorageProbe) -> None:
        P = self.page_size
        assert self.namespace is not None, "storage I/O runs only while a backend is attached"
        result: tuple[int, float] | None = None
        try:
            keys = page_hashes(probe.token_ids, P, None, salted_namespace(self.namespace, probe.salt))
            write = BackupOperation(probe.source, keys, payload=None)
            self._write_pages(write)  # as an L2 -> L3 backup
            if write.completed_tokens:
                op = PrefetchOperation("cost-probe", probe.token_ids, probe.scratch, None, salt=probe.salt)
                began = time.perf_counter()  # as _prefetch times it: hit query, then reads
                hit_pages = self._query_hits(op, keys)
                op.hash_value = keys[:hit_pages]
                self._read_pages(op, op.hash_value, probe.scratch[: hit_pages * P])
                seconds = time.perf_counter() - began
                self.stats.costs.observe("prefetch", op.completed_tokens, seconds)
                result = (op.completed_tokens, seconds) if op.completed_tokens else None
        except Exception as exc:
            self._released.append(torch.cat([probe.source, probe.scratch]))
            probe.done.set_exception(exc)
            return
        self._released.append(torch.cat([probe.source, probe.scratch]))
        probe.done.set_result(result)

    def _run_prefetch(self, item: PrefetchOperation | StorageProbe) -> None:
        if isinstance(item, StorageProbe):
            self._run_storage_probe(item)
        else:
            self._prefetch(item)

    def _prefetch(self, op: PrefetchOperation) -> None:
        """Hit query (MIN over ranks), then reads. Pushes exactly one release item per op (the slots it
        did not fill) and a revoke only for a hit below the threshold, so queue lengths match on every
        rank whenever the ranks have finished the same ops."""
        P = self.page_size
        began = time.perf_counter()
        assert self.namespace is not None, "storage I/O runs only while a backend is attached"
        seed = salted_namespace(self.namespace, op.salt)
        hashes = [] if op.terminated else page_hashes(op.token_ids, P, op.last_hash, seed)
        hit_pages = self._query_hits(op, hashes)
        hit_tokens = self.reduce_io("min", [hit_pages * P])[0]
        revoke = hit_tokens < self.prefetch_threshold
        with op.lock:
            op.hit_done = True
            op.hit_tokens = hit_tokens
            if revoke or op.terminated:
                op.terminated = True
            else:
                op.hash_value = hashes[: hit_tokens // P]
        if op.terminated:
            if revoke:
                self._revoked.append(op)
            self._released.append(op.host_indices)
            return
        self._read_pages(op, op.hash_value, op.host_indices[:hit_tokens])
        # what loading from L3 cost (hit query + reads), against recomputing (engine/cache/costs.py)
        self.stats.costs.observe("prefetch", op.completed_tokens, time.perf_counter() - began)
        completed = op.terminate() if op.failed or op.terminated else op.completed_tokens
        self._released.append(op.host_indices[completed:])

    def _query_hits(self, op: PrefetchOperation, hashes: list[str]) -> int:
        info = HiCacheStorageExtraInfo(prefix_keys=op.prefix_keys) if op.prefix_keys is not None else None
        hit = 0
        backend = self.backend
        assert backend is not None, "storage I/O runs only while a backend is attached"
        for start in range(0, len(hashes), STORAGE_BATCH_SIZE):
            batch = hashes[start : start + STORAGE_BATCH_SIZE]
            found = self._guarded("hit query", lambda batch=batch: backend.batch_exists(batch, info))
            hit += found or 0
            if not found or found < len(batch):
                break
        return hit

    def _read_pages(self, op: PrefetchOperation, keys: list[str], slots: torch.Tensor) -> None:
        P = self.page_size
        info = HiCacheStorageExtraInfo(prefix_keys=op.prefix_keys) if op.prefix_keys is not None else None
        for start in range(0, len(keys), STORAGE_BATCH_SIZE):
            batch = keys[start : start + STORAGE_BATCH_SIZE]
            batch_slots = slots[start * P : (start + len(batch)) * P]
            began = time.perf_counter()

            def read(batch=batch, batch_slots=batch_slots):
                if self.backend.supports_v1:
                    return self.backend.batch_get_v1(batch, batch_slots, info)
                return self._read_generic(batch, batch_slots)

            results = self._guarded("read", read) or []
            ok = _leading_true(results)
            self.stats.add(bytes_l3_read=ok * self.host_pool.page_bytes)
            self._observe_batch("prefetch", len(batch), ok, time.perf_counter() - began)
            if not op.increment(ok * P) or ok < len(batch):
                op.failed = ok < len(batch)
                return

    def _observe_batch(self, kind: str, pages: int, ok: int, seconds: float) -> None:
        """``{kind}_pgs`` (pages in the batch) and ``{kind}_bandwidth`` (GB/s of the pages that made it;
        only when some did), as upstream's storage collector."""
        self.stats.observe(f"{kind}_pgs", pages, self.backend_name)
        if ok and seconds > 0:
            gbps = ok * self.host_pool.page_bytes / seconds / 1e9
            self.stats.observe(f"{kind}_bandwidth", gbps, self.backend_name)

    def _read_generic(self, keys: list[str], slots: torch.Tensor) -> list[bool]:
        firsts = slots[:: self.page_size].tolist()
        scratch = [self.host_pool.get_flat_data_page(int(s)) for s in firsts]
        assert self.backend is not None, "storage I/O runs only while a backend is attached"
        pages = self.backend.batch_get(keys, scratch)
        results = []
        for first, page in zip(firsts, pages, strict=True):
            if page is None:
                results.append(False)
                continue
            self.host_pool.set_from_flat_data_page(int(first), page)
            results.append(True)
        return results

    # -- bookkeeping -----------------------------------------------------------------------------------------
    def inflight(self) -> dict[str, int]:
        """Copies not yet acknowledged and storage operations queued or running."""
        return {
            "writes": len(self._write_acks),
            "loads": len(self._load_acks) + len(self._load_queue),
            "backups": self._backuper.busy if self._backuper else 0,
            "prefetch_io": self._prefetcher.busy if self._prefetcher else 0,
        }

    def backend_errors(self) -> int:
        """Errors the backends counted themselves (``get_stats()["errors"]``): the attached one's plus
        those of backends detached earlier, so the total never goes down."""
        attached = self.backend.get_stats().get("errors", 0) if self.backend is not None else 0
        return self._detached_backend_errors + attached

    def close(self) -> None:
        """Stop every thread (storage ones too)."""
        self.detach_storage()
        self._writer.stop()
        self._loader.stop()


def _leading_true(results) -> int:
    count = 0
    for ok in results:
        if not ok:
            break
        count += 1
    return count
