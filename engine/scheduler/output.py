"""What the scheduler reports: a request's tokens and its end, its prompt log-probabilities, and the state
snapshot other threads read.

:class:`Output` appends a sampled token to a request (first-token and inter-token timings, the stop rule,
the grammar) and finishes requests (out of the decode set and the prefill queue, out of the PD queues,
KV released into the tree or not, the final event). Every event a request gets carries ``meta`` (:func:`meta`)
and the log-probabilities not sent yet (:func:`new_logprobs`). All of it runs on the scheduler thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from engine.scheduler.decode import DecodeManager
from engine.scheduler.kv_manager import KVManager
from engine.scheduler.logprobs import LogprobState, read
from engine.scheduler.prefill import PrefillManager
from engine.scheduler.req import Req, ReqOutput, ReqState

if TYPE_CHECKING:
    from engine.cache.protocols import PrefixCache
    from engine.scheduler.pd import DecodeQueues, PrefillQueues


class TokenMetrics(Protocol):
    """What :class:`Output` reports to the metrics sink (the server's collector): seconds to the first
    token and between tokens, and each finished request."""

    def on_first_token(self, seconds: float) -> None: ...

    def on_inter_token(self, seconds: float) -> None: ...

    def on_finish(self, req: Req) -> None: ...


class Output:
    """Tokens and ends of the requests in ``reqs`` (rid -> request, the scheduler's; a finished one is
    removed). ``decode`` / ``prefill`` / ``kv``: the scheduler's decode set, prefill queue and KV manager.
    ``pd()`` and ``metrics()`` return the PD queues and the metrics sink at call time (both may be set or
    replaced after construction; None when absent). ``pd_decode_offload`` (D): a finished PD request's KV
    is inserted into the tree (else D caches nothing)."""

    def __init__(
        self,
        reqs: dict[str, Req],
        decode: DecodeManager,
        prefill: PrefillManager,
        kv: KVManager,
        pd: Callable[[], PrefillQueues | DecodeQueues | None],
        metrics: Callable[[], TokenMetrics | None],
        pd_decode_offload: bool = False,
    ) -> None:
        self.reqs = reqs
        self.decode = decode
        self.prefill = prefill
        self.kv = kv
        self.pd = pd
        self.metrics = metrics
        self.pd_decode_offload = pd_decode_offload

    def append_token(self, req: Req, tok: int) -> None:
        """``req`` generated ``tok``: record its timing, then send it in an event, or finish ``req`` with it
        when the stop rule or the grammar ends the request."""
        metrics = self.metrics()
        now = time.perf_counter()
        if req.first_token_at is None:
            req.first_token_at = now
            if metrics:
                metrics.on_first_token(now - req.arrival)
        elif metrics:
            assert req.last_token_at is not None, "set with first_token_at"
            metrics.on_inter_token(now - req.last_token_at)
        req.last_token_at = now
        req.output_ids.append(tok)
        reason = self.decode.finish_reason(req, tok)
        if req.grammar is not None:
            reason = grammar_finish(req, tok) or reason
        if reason is None:
            req.on_event(ReqOutput(req.rid, [tok], meta=meta(req, False), logprobs=new_logprobs(req)))
        else:
            self.finish(req, reason, last_ids=[tok])

    def finish(self, req: Req, reason: dict, last_ids: list[int] | None = None, insert: bool = True) -> None:
        """End ``req`` with ``reason`` (upstream's finish reason; type ``abort`` makes it ABORTED): out of
        every queue, its KV released (the computed pages inserted into the tree when ``insert``), then its
        final event with ``last_ids``."""
        self.decode.remove(req)
        self.prefill.forget(req)
        pd = self.pd()
        if pd is not None:
            pd.drop(req)
            if req.bootstrap and not pd.sends_kv:
                insert = insert and self.pd_decode_offload  # else D caches nothing
        if req.kv is not None:
            self.kv.release(req.kv, req.fill_ids, insert=insert)
            req.kv = None
        req.move(ReqState.ABORTED if reason["type"] == "abort" else ReqState.FINISHED)
        self.reqs.pop(req.rid, None)
        metrics = self.metrics()
        if metrics:
            metrics.on_finish(req)
        out = ReqOutput(req.rid, last_ids or [], True, reason, meta(req, final=True))
        out.logprobs = new_logprobs(req)
        req.on_event(out)

    def abort(self, req: Req, message: str) -> None:
        """Finish ``req`` (unless it already is) as an abort with ``message``, inserting nothing."""
        if not req.finished:
            self.finish(req, {"type": "abort", "message": message}, insert=False)

    def abort_all(self, reqs: list[Req], message: str) -> None:
        """Finish every one of ``reqs`` (a batch whose forward pass failed) as an abort with ``message``,
        inserting nothing."""
        for req in reqs:
            self.finish(req, {"type": "abort", "message": message}, insert=False)

    def cancel(self, rid: str) -> None:
        """A client's abort of request ``rid`` (unknown or finished: ignored). In a PD room: the PD queues
        tell the peer and end it once the room is terminal; waiting or mid-way through a chunked prefill: it
        ends now; otherwise it is marked and ends at its next token."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        pd = self.pd()
        if req.state in (ReqState.BOOTSTRAPPING, ReqState.TRANSFERRING, ReqState.WAITING_FOR_KV):
            assert pd is not None, f"{rid}: only the PD queues move a request to {req.state}"
            pd.abort(req)  # ends once the room is terminal
        elif self.prefill.unqueue(req):
            if pd is not None:
                pd.drop(req)
            self.reqs.pop(rid, None)
            req.move(ReqState.ABORTED)
            req.on_event(ReqOutput(rid, [], True, {"type": "abort", "message": "aborted"}, meta(req, True)))
        elif req is self.prefill.chunked:
            self.finish(req, {"type": "abort", "message": "aborted"}, insert=False)
        else:
            req.aborted = "aborted"


def refuse(req: Req, reason: dict) -> None:
    """End ``req``, never queued, at once with the abort ``reason`` (an event with no meta)."""
    req.move(ReqState.ABORTED)
    req.on_event(ReqOutput(req.rid, [], True, reason, {}))


def meta(req: Req, final: bool) -> dict:
    """``meta_info`` of an event of ``req``: token counts and cached tokens per tier, and (attribution on)
    ``miss_tokens_details``: the other prompt tokens by miss cause, ``{"causes": {cause: tokens},
    "evicted_by": {eviction policy: tokens}}`` (``Misses.meta``); a ``final`` one adds
    ``e2e_latency``, ``queue_time`` and ``ttft`` (seconds) where known."""
    info = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "cached_tokens_details": dict(req.cached),
    }
    if req.misses is not None:
        info["miss_tokens_details"] = req.misses.meta()
    if final:
        now = time.perf_counter()
        info["e2e_latency"] = now - req.arrival
        if req.admitted_at is not None:
            info["queue_time"] = req.admitted_at - req.arrival
        if req.first_token_at is not None:
            info["ttft"] = req.first_token_at - req.arrival
    return info


def new_logprobs(req: Req) -> dict | None:
    """The log-probabilities an event of ``req`` carries (those not sent yet); None if it asked for none."""
    state: LogprobState | None = req.logprob
    return None if state is None else state.take_new(len(req.output_ids))


def grammar_finish(req: Req, tok: int) -> dict | None:
    """Advance ``req``'s grammar past ``tok`` (on a PD decode worker, P's first token rebuilds its state
    here): a stop once the grammar has terminated, an abort (400) when it refuses the token."""
    assert req.grammar is not None
    if not req.grammar.accept(tok):
        return {"type": "abort", "message": f"the grammar does not allow token {tok}", "status_code": 400}
    if req.grammar.terminated:
        return {"type": "stop", "matched": tok}
    return None


def prompt_rows(req: Req, start: int, end: int) -> range:
    """Positions of the extend range ``[start, end)`` whose logits rows give ``req`` a prompt
    log-probability (row ``p`` scores prompt token ``p + 1``; positions ``logprob_start_len`` up to the
    second last)."""
    if req.logprob is None:
        return range(0)
    return range(max(start, req.logprob.want.start), min(end, len(req.input_ids) - 1))


def read_prompt_logprobs(items: list[tuple[Req, int, int]], logits: torch.Tensor) -> torch.Tensor:
    """Record each request's prompt log-probabilities from the all-positions ``logits`` ``(T, vocab)`` of
    the extend ranges ``items`` (raw, as upstream: no temperature, no penalty); returns each sequence's last
    row ``(B, vocab)``."""
    offset, last = 0, []
    for req, start, end in items:
        rows = prompt_rows(req, start, end)
        if rows and req.logprob is not None:
            lo = offset + rows.start - start
            lp = torch.log_softmax(logits[lo : lo + len(rows)].float(), dim=-1)
            chosen = [req.input_ids[p + 1] for p in rows]
            req.logprob.input.extend(read(lp, chosen, req.logprob.want))
        offset += end - start
        last.append(offset - 1)
    return logits[last]


def snapshot(
    cache: PrefixCache,
    pool_size: int,
    *,
    running: int,
    waiting: int,
    pd_transfer: int,
    http: int,
    idle: bool,
    pd_queues: dict | None = None,
    cache_hit_rate: float = 0.0,
) -> dict:
    """The state other threads read: request counts (``running`` decoding or chunked, ``waiting`` to be
    prefilled, ``pd_transfer`` in the PD queues, ``pd_queues`` the same per queue by upstream's /v1/loads
    names, ``http`` accepted by the HTTP server), ``idle``, ``cache_hit_rate`` (the last prefill batch's
    cached over prompt tokens, 0..1), the cache's I/O in flight, settings, breaker,
    counters and per-tenant usage, and L1 use in tokens of a pool of ``pool_size``."""
    hierarchical = cache.enable_hierarchical
    evictable = cache.evictable_size()
    return {
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_pd_transfer_reqs": pd_transfer,
        "pd_queues": dict(pd_queues or {}),
        "num_http_reqs": http,
        "inflight_cache_io": dict(cache.inflight_io()),
        "is_idle": idle,
        "cache_hit_rate": cache_hit_rate,
        "hicache": cache.storage_status() if hierarchical else None,
        "storage_health": cache.storage.health() if hierarchical else None,
        "cache_stats": cache.stats.snapshot(),
        "tenant_usage": cache.tenant_usage() if hierarchical else {},
        "num_used_tokens": pool_size - cache.device_allocator.available_size() - evictable,
        "evictable_tokens": evictable,
        "max_total_num_tokens": pool_size,
    }
