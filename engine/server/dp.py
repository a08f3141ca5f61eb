"""DP attention (``--dp-size N --enable-dp-attention``): N attention data-parallel ranks in one worker.

Each DP rank is one :class:`~engine.scheduler.Scheduler` with its own thread, L1 pool, radix tree and L2 host
pool; the model weights are one read-only copy every rank's forward passes share; every rank's L3 keys are
the same (one namespace: a page one rank backed up is a hit for every rank). Rank 0 is ``Engine.scheduler``.

Dispatch (:func:`choose_rank`, the documented rule, docs/architecture.md "DP attention"): a request goes to
the rank whose radix tree holds the longest prefix of its prompt (L1 or L2, read-only ``RadixTree.peek``, in
the request's cache salt), when that match is at least ``AFFINITY_MIN_TOKENS`` and the rank's load (requests
dispatched to it and not finished) is within ``BALANCE_ABS_THRESHOLD`` of the least-loaded rank; otherwise to
the least-loaded rank. Ties: fewer requests dispatched so far, then the lower rank. So a conversation's next
turn (its prompt extends the last turn's) finds its KV on the rank that computed it.

Admin work (:class:`DPAdmin`) reaches every rank **all-or-nothing**: new requests wait at the dispatcher
while it runs (``DPDispatcher.gate``), ranks are changed in order, and a failure on rank k undoes ranks
0..k-1 (attach -> detach and close, detach -> re-attach the taken backend, config -> the old values, clear ->
resume the paused ranks; a flush checks every rank is idle before it drops any cache, since a flush cannot be
undone). The error names the rank and why (:class:`DPAdminError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence

from engine.cache.admin import PreparedBackend
from engine.cache.hiradix_cache import CacheAdminError
from engine.scheduler import Scheduler
from engine.scheduler.messages import (
    AdminMsg,
    AttachStorage,
    DetachStorage,
    FlushCache,
    NotIdleError,
    PauseStorage,
    ReadStorage,
    RequireIdle,
    ResumeStorage,
    UpdatePolicies,
)

AFFINITY_MIN_TOKENS = 16
"""A cached prefix shorter than this (a BOS, a short shared system prompt) does not pull a request to a
rank: such prefixes are cheap to recompute and would otherwise send all traffic to one rank."""

BALANCE_ABS_THRESHOLD = 32
"""Prefix affinity yields when the matched rank has this many more requests in flight than the least-loaded
one (sglang-router's cache-aware ``balance_abs_threshold`` default)."""

# cache setting (UpdatePolicies field) -> its name in ReadStorage("config")'s status
_STATUS_NAMES = {
    "prefetch_policy": "hicache_storage_prefetch_policy",
    "write_policy": "hicache_write_policy",
    "eviction_policy": "radix_eviction_policy",
}


def choose_rank(matched: Sequence[int], loads: Sequence[int], dispatched: Sequence[int]) -> int:
    """The DP rank for one request (the module docstring's rule).

    ``matched[i]``: tokens of the prompt's longest cached prefix on rank i; ``loads[i]``: requests in flight
    on rank i; ``dispatched[i]``: requests sent to rank i so far (the round-robin tie-break). All the same
    length >= 1. Returns an index into them.
    """
    n = len(matched)
    least = min(range(n), key=lambda i: (loads[i], dispatched[i], i))
    best = min(range(n), key=lambda i: (-matched[i], loads[i], dispatched[i], i))
    if matched[best] >= AFFINITY_MIN_TOKENS and loads[best] - loads[least] <= BALANCE_ABS_THRESHOLD:
        return best
    return least


class DPAdminError(RuntimeError):
    """An admin operation failed on one DP rank (the others were rolled back); the message names it."""

    def __init__(self, rank: int, size: int, cause: BaseException, undone: int = 0):
        self.rank, self.cause, self.undone = rank, cause, undone
        text = str(cause) if size == 1 else f"DP rank {rank} of {size}: {cause}"
        if undone:
            text += (
                f" (rolled back on DP rank{'s' if undone > 1 else ''} {', '.join(map(str, range(undone)))})"
            )
        super().__init__(text)


class DPDispatcher:
    """Picks the DP rank of each request and counts what each rank has in flight. Event-loop thread only."""

    def __init__(self, schedulers: Sequence[Scheduler]):
        self.schedulers = list(schedulers)
        n = len(self.schedulers)
        self.loads = [0] * n  # dispatched, not finished
        self.dispatched = [0] * n
        self._open = asyncio.Event()
        self._open.set()

    @property
    def size(self) -> int:
        return len(self.schedulers)

    def matched(self, input_ids: list[int], salt: str | None) -> list[int]:
        """Tokens of ``input_ids``' longest cached prefix in each rank's radix tree (read-only, no lock:
        a hint, see ``RadixTree.peek``; a racing read that fails counts 0)."""
        out = []
        for sched in self.schedulers:
            try:
                out.append(sched.cache.tree.peek(input_ids, salt))
            except Exception:  # the owner thread changed the tree under the walk: no hint from this rank
                out.append(0)
        return out

    async def pick(self, input_ids: list[int], salt: str | None) -> int:
        """The rank for a request (waits while admin work holds the gate) and counts it as in flight there;
        the caller calls ``done(rank)`` when the request has finished."""
        if self.size == 1:
            rank = 0
        else:
            await self._open.wait()
            rank = choose_rank(self.matched(input_ids, salt), self.loads, self.dispatched)
        self.loads[rank] += 1
        self.dispatched[rank] += 1
        return rank

    def done(self, rank: int) -> None:
        self.loads[rank] -= 1

    @contextlib.asynccontextmanager
    async def gate(self):
        """While held, new requests wait before dispatch (requests already dispatched go on)."""
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()


class DPAdmin:
    """Admin messages carried to every DP rank, all-or-nothing (module docstring). One at a time."""

    def __init__(self, dispatcher: DPDispatcher):
        self.dispatcher = dispatcher
        self._lock = asyncio.Lock()

    @property
    def schedulers(self) -> list[Scheduler]:
        return self.dispatcher.schedulers

    @staticmethod
    async def post(sched: Scheduler, msg: AdminMsg, timeout: float | None = None):
        return await asyncio.wait_for(asyncio.wrap_future(sched.post(msg)), timeout)

    def _error(self, rank: int, exc: BaseException, undone: int = 0) -> DPAdminError:
        """The error naming ``rank``; ``undone``: ranks 0..undone-1 were changed, then put back."""
        return DPAdminError(rank, len(self.schedulers), exc, undone)

    async def attach(self, name: str, extra: str | None, prefetch: str | None, write: str | None):
        """Attach L3 backend ``name`` on every rank (each prepares its own instance off the scheduler
        thread; same namespace). Returns rank 0's ``(message, live status)``. ``DPAdminError`` (its cause a
        ``CacheAdminError`` / ``NotIdleError`` / ``ValueError``) after undoing the ranks that attached."""
        async with self._lock, self.dispatcher.gate():
            undo: list[tuple[Scheduler, object]] = []  # (rank, prepared it attached | old policies)
            result = None
            for i, sched in enumerate(self.schedulers):
                storage = sched.cache.storage
                prepared = None
                try:
                    old = await self.post(sched, ReadStorage("config"))
                    if storage.name is None:  # start the backend here, off the scheduler thread
                        prepared = await asyncio.to_thread(storage.prepare, name, extra)
                    attach = AttachStorage(name if prepared is None else prepared, extra, prefetch, write)
                    got = await self.post(sched, attach)
                except BaseException as exc:
                    if prepared is not None and storage.backend is not prepared.instance:
                        await asyncio.to_thread(prepared.close)
                    await self._undo_attach(undo)
                    if isinstance(exc, (NotIdleError, CacheAdminError, ValueError)):
                        raise self._error(i, exc, len(undo)) from None
                    raise
                undo.append((sched, prepared if prepared is not None else old))
                result = result or got
            return result

    async def _undo_attach(self, undo: list[tuple[Scheduler, object]]) -> None:
        for sched, what in reversed(undo):
            if isinstance(what, dict):  # a re-attach changed only the policies: put them back
                fields = {
                    "prefetch_policy": what["hicache_storage_prefetch_policy"],
                    "write_policy": what["hicache_write_policy"],
                }
                await self.post(sched, UpdatePolicies(fields))
            else:
                taken = await self.post(sched, DetachStorage())
                if taken is not None:
                    await asyncio.to_thread(taken.close)

    async def detach(self) -> None:
        """Detach L3 on every rank; the taken backends are closed once every rank let go. On a failure at
        rank k the backends taken from ranks 0..k-1 are attached again; ``DPAdminError``."""
        taken: list[tuple[Scheduler, PreparedBackend | None, dict]] = []
        async with self._lock, self.dispatcher.gate():
            for i, sched in enumerate(self.schedulers):
                try:
                    status = await self.post(sched, ReadStorage("config"))
                    got = await self.post(sched, DetachStorage())
                except (NotIdleError, CacheAdminError, ValueError) as exc:
                    for s, prepared, st in reversed(taken):
                        if prepared is not None:
                            policies = (st["hicache_storage_prefetch_policy"], st["hicache_write_policy"])
                            await self.post(s, AttachStorage(prepared, None, *policies))
                    raise self._error(i, exc, len(taken)) from None
                taken.append((sched, got, status))
        for _, prepared, _ in taken:  # outside the lock and gate: a store that does not answer may hold it
            if prepared is not None:
                await asyncio.to_thread(prepared.close)

    async def update_policies(self, fields: dict) -> dict:
        """``UpdatePolicies(fields)`` on every rank; rank 0's new status. On a failure at rank k, ranks
        0..k-1 get their old values back; ``DPAdminError``."""
        async with self._lock, self.dispatcher.gate():
            done: list[tuple[Scheduler, dict]] = []
            result = None
            for i, sched in enumerate(self.schedulers):
                try:
                    old = await self.post(sched, ReadStorage("config"))
                    status = await self.post(sched, UpdatePolicies(fields))
                except (NotIdleError, CacheAdminError, ValueError) as exc:
                    for s, st in reversed(done):
                        await self.post(s, UpdatePolicies({k: st[_STATUS_NAMES.get(k, k)] for k in fields}))
                    raise self._error(i, exc, len(done)) from None
                done.append((sched, old))
                result = result or status
            assert result is not None, "a worker has at least one DP rank"
            return result

    async def clear(self) -> None:
        """Wipe L3 once (one namespace): pause L3 I/O on every rank (a failure resumes the paused ones:
        ``DPAdminError``), clear through rank 0's backend, resume every rank. ``CacheAdminError`` when the
        store's clear fails (every rank resumed). Only the pausing holds the admin lock and the dispatch
        gate: the clear itself may wait long on a store that does not answer, while the ranks serve and
        refuse other admin work ("a clear ... is running") until they resume."""
        paused: list[tuple[Scheduler, object]] = []
        async with self._lock, self.dispatcher.gate():
            for i, sched in enumerate(self.schedulers):
                try:
                    paused.append((sched, await self.post(sched, PauseStorage())))
                except (NotIdleError, CacheAdminError, ValueError) as exc:
                    for s, p in paused:
                        await self.post(s, ResumeStorage(p))
                    raise self._error(i, exc, len(paused)) from None
        try:
            await asyncio.to_thread(paused[0][1].clear)  # type: ignore[attr-defined]
        finally:
            for sched, p in paused:
                await self.post(sched, ResumeStorage(p))

    async def flush(self) -> None:
        """Clear L1 and L2 of every rank, or of none: every rank must be idle first (``RequireIdle``;
        ``DPAdminError`` naming the busy rank), then each flushes (new requests wait at the gate meanwhile,
        so no rank turns busy in between)."""
        async with self._lock, self.dispatcher.gate():
            for i, sched in enumerate(self.schedulers):
                try:
                    await self.post(sched, RequireIdle("flush cache"))
                except NotIdleError as exc:
                    raise self._error(i, exc) from None
            for i, sched in enumerate(self.schedulers):
                try:
                    await self.post(sched, FlushCache())
                except NotIdleError as exc:
                    raise self._error(i, exc) from None


class SharedRunner:
    """One DP rank's view of the worker's model runner: the same read-only weights for every rank; their
    forward passes take turns on the one device (``lock``), while each rank's scheduling, radix tree and
    cache I/O run on its own thread. Implements the scheduler's ``Runner`` seam."""

    def __init__(self, runner, lock: threading.Lock):
        self.runner, self.lock = runner, lock

    def forward(self, batch, kv_pool, return_all_logits: bool = False):
        """``ModelRunner.forward`` under the worker's forward lock."""
        with self.lock:
            return self.runner.forward(batch, kv_pool, return_all_logits)
