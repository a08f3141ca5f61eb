"""The cost probe (``POST /hicache/costs/probe``): what loading costs against recomputing, measured on demand.

A worker's costs (engine/cache/costs.py) come from its traffic; a worker whose traffic is thin (or has never
loaded anything back) has nothing for the control plane's crossover to read. The probe measures the three
operations at a few sizes now and records them into the same ``TransferCosts`` (so ``sglang:kv_cost_*`` and
``GET /hicache/costs`` carry them and the crossover needs no change). A probe's observations join traffic's
sums (no label tells them apart: a probe is a handful of operations, and the answer lists exactly what it
added).

Per size ``n`` (tokens, whole pages), on the scheduler thread while idle (:func:`start`):

- ``prefill``: one forward pass over ``n`` synthetic tokens into ``n`` scratch L1 slots (the runner's
  forward, as a prefill batch runs it), timed from building the batch until the argmax of its logits is on
  the host;
- ``load_back``: the pass's KV copied L1 -> L2 into ``n`` scratch host slots, then copied back L2 -> L1 with
  the load thread's copy routine (``HiCacheController.probe_load``), timed until the bytes are in L1;
- ``prefetch`` (an L3 backend attached): the host copy is written to L3 under the page keys of the synthetic
  tokens in a key space of its own (a random ``cache_salt``, so no real prompt's key chain can reach these
  pages), then read back into ``n`` more scratch host slots as one prefetch (hit query plus reads) on the
  prefetch thread (``StorageProbe``): no store call runs on the scheduler thread.

Why scratch slots and no radix tree: the probe's pages are never inserted, so no real prompt can match them
(L1/L2), nothing of the traffic's cache is evicted to make room (sizes are capped by the free slots), and
nothing is to be removed afterwards except the slots themselves. The L1 slots are freed before ``start``
returns; the host slots come back through the prefetch thread's release queue (:func:`finish` processes it),
or at once without L3. At tp > 1 every rank runs it (an announced admin message) with the same sizes; with
DP attention the route probes DP rank 0. The L3 pages stay in the store (no backend has a per-key delete)
under keys no request can compute; the store's own eviction or a clear removes them.
"""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from dataclasses import dataclass, field

from engine.cache.controller import StorageProbe
from engine.cache.hiradix_cache import CacheAdminError
from engine.model.forward_batch import ForwardBatch

DEFAULT_SIZES = (16, 256, 1024, 4096)
"""Tokens probed when no sizes are given (each rounded up to whole pages, capped by :func:`limit`)."""

MIN_DEFAULT = 3
"""The default sizes are filled up with the smallest page multiples to at least this many while they fit:
the control plane's crossover fits an operation from 3 observations on (``MIN_OPERATIONS``)."""

MAX_SIZES = 8
"""At most this many sizes per probe."""

SYNTHETIC_VOCAB = 256
"""Synthetic token ids are drawn below this (and below the model's vocabulary): ids any tokenizer has."""


@dataclass
class ProbeStarted:
    """What :func:`start` measured: ``measured`` ``[{"operation", "tokens", "seconds"}]`` (prefill and
    load-back, in size order), ``pending`` the L3 round trips still running on the prefetch thread (their
    futures give ``(tokens, seconds)`` or None), ``skipped`` ``[{"operation", "tokens", "why"}]``."""

    page_size: int
    measured: list[dict] = field(default_factory=list)
    pending: list[tuple[int, concurrent.futures.Future]] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)


def limit(sched) -> int:
    """The largest size (tokens, whole pages) a probe may use now: the free L1 slots, the free L2 slots (half
    of them with L3: two host copies per size) and one prefill pass (``chunked_prefill_size``, else
    ``max_prefill_tokens``); at tp > 1 the smallest over the ranks, so every rank runs the same passes."""
    cache = sched.cache
    assert cache.host_pool is not None, "the probe runs only with a hierarchical cache"
    host = cache.host_pool.available_size() // (2 if cache.storage.backend is not None else 1)
    chunk = sched.config.chunked_prefill_size
    one_pass = chunk if chunk > 0 else sched.config.max_prefill_tokens
    page = cache.page_size
    cap = min(cache.device_allocator.available_size(), host, one_pass) // page * page
    return cache.reduce("min", [cap])[0]  # tensor parallel: every rank probes the same sizes (one forward)


def plan(sizes: tuple[int, ...] | None, page_size: int, cap: int) -> list[int]:
    """The sizes to probe (tokens): each rounded up to whole pages, duplicates dropped, ascending. None: the
    default sizes within ``cap`` (floored to whole pages), at least ``MIN_DEFAULT`` of them where ``cap``
    holds as many pages. Raises ``ValueError`` naming ``sizes`` for an empty list, more than ``MAX_SIZES``, a
    size < 1 or one over ``cap``, and when ``cap`` is under one page."""
    cap = cap // page_size * page_size
    if cap < page_size:
        raise ValueError(
            f"sizes: not even one page ({page_size} tokens) of free L1/L2 slots to probe with (free: {cap}); "
            "the probe takes free slots only and never evicts the cache; a worker whose cache is full has "
            "traffic enough to measure the costs from"
        )
    if sizes is None:
        chosen = {min(-(-s // page_size) * page_size, cap) for s in DEFAULT_SIZES}
        for n in range(page_size, cap + 1, page_size):  # small pools: at least MIN_DEFAULT sizes if they fit
            if len(chosen) >= MIN_DEFAULT:
                break
            chosen.add(n)
        return sorted(chosen)
    if not sizes or len(sizes) > MAX_SIZES:
        raise ValueError(f"sizes: give 1 to {MAX_SIZES} sizes in tokens, got {len(sizes)}")
    out = set()
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"sizes: each size is a positive number of tokens, got {s!r}")
        n = -(-s // page_size) * page_size
        if n > cap:
            raise ValueError(
                f"sizes: {s} tokens ({n} as whole pages) exceed what the probe can use now ({cap} tokens: "
                "free L1 slots, free L2 slots (half with L3) and one prefill pass)"
            )
        out.add(n)
    return sorted(out)


def synthetic_tokens(index: int, n: int, vocab: int) -> list[int]:
    """The ``n`` token ids (in ``1 .. vocab - 1``) probed at the ``index``-th size."""
    return [1 + (index * 7919 + j * 104729) % max(vocab - 1, 1) for j in range(n)]


def start(sched, sizes: tuple[int, ...] | None) -> ProbeStarted:
    """Probe on the scheduler thread (the module docstring): refuses with ``NotIdleError`` unless idle,
    ``CacheAdminError`` without a hierarchical cache, ``ValueError`` naming ``sizes``. The L3 round trips it
    queues finish on the prefetch thread; the caller awaits ``pending`` and then posts ``FinishProbe``."""
    sched.require_idle("cost probe")
    cache = sched.cache
    controller = cache.controller
    if controller is None or cache.host_pool is None:
        raise CacheAdminError("Reject cost probe: hierarchical cache is not enabled")
    page = cache.page_size
    todo = plan(sizes, page, limit(sched))
    out = ProbeStarted(page)
    with_l3 = cache.storage.backend is not None
    if not with_l3:
        out.skipped += [{"operation": "prefetch", "tokens": n, "why": "no L3 backend attached"} for n in todo]
    vocab = min(SYNTHETIC_VOCAB, getattr(getattr(sched.runner, "config", None), "vocab_size", 0) or 1 << 30)
    salt = f"kvfleet-cost-probe-{uuid.uuid4().hex}"
    for i, n in enumerate(todo):
        tokens = synthetic_tokens(i, n, vocab)
        device = cache.alloc_device(n)
        host = cache.alloc_host(n)
        assert device is not None and host is not None, "plan() capped sizes by the free slots"
        keep_host = False
        try:
            began = time.perf_counter()  # as a prefill batch is timed: from building the batch
            batch = ForwardBatch.from_sequences([tokens], [device], None, sched.pool.device)
            logits = sched.runner.forward(batch, sched.pool)
            logits.argmax(-1).tolist()  # on the host: the pass has finished on the device
            seconds = time.perf_counter() - began
            cache.stats.costs.observe("prefill", n, seconds)
            out.measured.append({"operation": "prefill", "tokens": n, "seconds": seconds})
            controller.io.backup(device, host)  # L1 -> L2 (synchronous, as a write-back copies)
            seconds = controller.probe_load(device, host)
            out.measured.append({"operation": "load_back", "tokens": n, "seconds": seconds})
            if with_l3:
                scratch = cache.alloc_host(n)
                if scratch is None:
                    out.skipped.append({"operation": "prefetch", "tokens": n, "why": "no free L2 slots"})
                else:
                    probe = StorageProbe(tokens, salt, host, scratch)
                    controller.probe_storage(probe)
                    keep_host = True  # the prefetch thread releases both
                    out.pending.append((n, probe.done))
        finally:
            cache.free_device(device)
            if not keep_host:
                cache.free_host(host)
    return out


def finish(sched, timeout: float = 30.0) -> None:
    """Process cache I/O events until nothing is in flight (the probe's host slots are freed with them);
    raises ``TimeoutError`` after ``timeout`` seconds (the slots are then freed by a later iteration)."""
    sched.cache.drain_io(timeout)


def answer(started: ProbeStarted, l3: list[tuple[int, object]]) -> dict:
    """The route's answer: ``page_size``, ``measured`` (prefill and load-back, then prefetch, each
    ``{"operation", "tokens", "seconds"}``) and ``skipped``. ``l3``: per pending size its
    ``(tokens, seconds)``, None (nothing came back) or the exception it raised."""
    measured = list(started.measured)
    skipped = list(started.skipped)
    for n, got in l3:
        if isinstance(got, tuple):
            measured.append({"operation": "prefetch", "tokens": got[0], "seconds": got[1]})
        else:
            why = f"the store failed: {got}" if isinstance(got, BaseException) else "the store kept nothing"
            skipped.append({"operation": "prefetch", "tokens": n, "why": why})
    return {"page_size": started.page_size, "measured": measured, "skipped": skipped}
