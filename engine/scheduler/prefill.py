"""The prefill policy: which waiting requests the next prefill batch takes, and how much of each.

After mini-sglang's ``PrefillManager`` and nano-vllm's scheduler: the waiting queue in arrival order (a
health probe goes first), one request at most part-way through a chunked prefill. ``schedule`` picks the
extend ranges of the next batch under a token budget (``max_prefill_tokens``, capped by
``chunked_prefill_size`` when chunking is on) and ``max_running_requests``; the one request that does not fit
is split and continued first in the next batch (without chunking a long prompt waits for a batch of its own).
A request is taken only once its L3 prefetch allows it and admission leases its KV (``KVManager.admit``:
prompt + its decode reservation); the first request that finds no room stops the batch (arrival order holds).
Runs on the scheduler thread; it runs no model and sends no event.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.scheduler.kv_manager import KVManager
from engine.scheduler.req import Req, ReqState


@dataclass(frozen=True)
class PrefillBudget:
    """Limits of one prefill batch, in tokens (``chunked_prefill_size`` <= 0: no chunking) and requests."""

    max_prefill_tokens: int
    chunked_prefill_size: int
    max_running_requests: int


class PrefillManager:
    """The waiting queue, the chunked request and admission into prefill batches.

    ``decode_tokens(req)``: how many positions past the prompt admission reserves for ``req`` (its
    ``max_new_tokens``, 0 for a request whose KV goes to a decode worker). ``on_admit(req)`` is called for
    each admitted request (metrics).
    """

    def __init__(
        self,
        budget: PrefillBudget,
        kv: KVManager,
        decode_tokens: Callable[[Req], int],
        on_admit: Callable[[Req], None] | None = None,
    ) -> None:
        self.budget = budget
        self.kv = kv
        self.decode_tokens = decode_tokens
        self.on_admit = on_admit
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None

    def __len__(self) -> int:
        """Requests waiting or part-way through a chunked prefill."""
        return len(self.waiting) + (self.chunked is not None)

    def add(self, req: Req) -> None:
        """Queue ``req`` (a health probe goes first) and start an L3 prefetch of its prefix."""
        if req.health_check:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)
        if self.kv.start_prefetch(req.rid, req.input_ids[:-1], req.cache_salt):
            req.move(ReqState.PREFETCHING)

    def unqueue(self, req: Req) -> bool:
        """Take a waiting ``req`` out of the queue and cancel its prefetch; False if it was not waiting."""
        if req not in self.waiting:
            return False
        self.waiting.remove(req)
        self.kv.drop_prefetch(req.rid)
        return True

    def forget(self, req: Req) -> None:
        """``req`` ended: it is no longer the chunked request."""
        if self.chunked is req:
            self.chunked = None

    def schedule(self, num_running: int) -> list[tuple[Req, int, int]]:
        """The next batch as ``(req, start, end)`` extend ranges over ``req.fill_ids``; admits what it takes.

        ``num_running``: requests decoding now (they count against ``max_running_requests``).
        """
        chunk = self.budget.chunked_prefill_size
        budget = self.budget.max_prefill_tokens
        if chunk > 0:
            budget = min(budget, chunk)
        items: list[tuple[Req, int, int]] = []
        if self.chunked is not None:
            req = self.chunked
            done = req.lease.num_computed
            end = min(len(req.input_ids), done + budget)
            items.append((req, done, end))
            budget -= end - done
            self.chunked = None if end == len(req.input_ids) else req
            if self.chunked is not None:
                return items
        for req in list(self.waiting):
            if budget <= 0 or num_running + len(items) >= self.budget.max_running_requests:
                break
            if chunk <= 0 and items and len(req.input_ids) > budget:
                break  # no chunking: a long prompt waits for a batch of its own
            if not self.kv.prefetch_ready(req.rid):
                continue
            if not self._admit(req):
                break
            self.waiting.remove(req)
            done = req.lease.num_computed
            end = len(req.input_ids)
            if end - done > budget and chunk > 0:
                end = done + budget
                self.chunked = req
            items.append((req, done, end))
            budget -= end - done
            if self.chunked is not None:
                break
        return items

    def _admit(self, req: Req) -> bool:
        """Lease the request's cached prefix (L2 part loaded back) and slots for prompt + its decode
        reservation; False if L1 has no room. The last prompt token is never matched, and a request that
        asks for prompt log-probabilities matches at most ``logprob_start_len`` tokens (their logits rows are
        computed by its own forward pass, whatever tier held the prefix)."""
        reserve = len(req.input_ids) + self.decode_tokens(req)
        cap = len(req.input_ids) - 1
        if req.logprob is not None:
            cap = min(cap, req.logprob.want.prefix_cap())
        lease = self.kv.admit(
            req.rid, req.input_ids[:cap], reserve, salt=req.cache_salt, prompt_len=len(req.input_ids)
        )
        if lease is None:
            return False
        req.kv = lease
        req.cached = dict(lease.cached)
        req.misses = lease.misses
        self.kv.cache.stats.record_cached_tokens(**req.cached)
        req.move(ReqState.LOADING if lease.cached["host"] + lease.cached["storage"] else ReqState.PREFILLING)
        req.admitted_at = time.perf_counter()
        if self.on_admit is not None:
            self.on_admit(req)
        return True
