"""The scheduler thread: the loop of continuous batching with chunked prefill over the hierarchical cache.

One thread owns the model runner and the cache. Other threads talk to it only through its inbox: ``submit``
(a new request), ``abort`` (an ``AbortReq``) and ``post`` (an admin message of ``engine.scheduler.messages``,
answered through a ``concurrent.futures.Future``); they read the ``state`` snapshot it publishes after every
iteration. ``call`` (run a function on this thread) is for tests and tools, not for the server.

Each iteration: drain the inbox, poll the PD queues, then one forward pass: a prefill batch if the prefill
policy (``PrefillManager``, ``engine/scheduler/prefill.py``: arrival order under a token budget, chunking,
admission) picks one, else one decode step of every running request (``DecodeManager``,
``engine/scheduler/decode.py``). Admission reserves L1 slots for the whole prompt plus ``max_new_tokens``
(evicting unlocked cache nodes when short), so no request runs out of KV mid-way and nothing is ever
retracted. After a forward pass a ``BatchSampler`` (``engine/scheduler/sampler.py``) picks the tokens, the
scheduler makes the prompt-done decision, and ``Output`` (``engine/scheduler/output.py``) appends tokens,
finishes requests and builds the events and the state snapshot.
Prefix reuse: ``match_prefix`` gives the L1 hit; an L2 hit is loaded back with ``init_load_back`` before the
forward pass (which waits per layer through ``cache.wait_layer``); an L3 prefetch is started when the request
is queued and ``check_prefetch_progress`` decides when it may be scheduled (per the prefetch policy).
The last prompt token is never matched, so at least one token is always computed.
Overload (``max_queued_requests``, upstream's ``--max-queued-requests``): a request arriving while that many
wait is finished at once with upstream's abort (503, "The request queue is full."), so a client or router
learns at once instead of waiting out its timeout.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.cache.protocols import PrefixCache
from engine.model.forward_batch import ForwardBatch
from engine.model.vlm.mm import batch_embeds, mrope_positions
from engine.scheduler import admin
from engine.scheduler.decode import DecodeManager
from engine.scheduler.inbox import Command, Inbox
from engine.scheduler.kv_manager import KVManager
from engine.scheduler.messages import AbortReq, AdminMsg, NotIdleError
from engine.scheduler.output import Output, prompt_rows, read_prompt_logprobs, refuse, snapshot
from engine.scheduler.pd import DecodeQueues, PDHooks, PrefillQueues, make_queues
from engine.scheduler.prefill import PrefillBudget, PrefillManager
from engine.scheduler.protocols import Runner
from engine.scheduler.req import Req, ReqState
from engine.scheduler.sampler import BatchSampler
from engine.scheduler.tp_sync import TPSync

logger = logging.getLogger(__name__)

__all__ = ["NotIdleError", "QUEUE_FULL", "Scheduler", "SchedulerConfig"]


QUEUE_FULL = "The request queue is full."  # upstream's abort message (HTTP 503)


@dataclass
class SchedulerConfig:
    """Batching limits (tokens). ``chunked_prefill_size`` <= 0 turns chunking off."""

    context_length: int
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 8192
    max_running_requests: int = 256
    max_queued_requests: int | None = None  # None: unbounded (upstream's default)
    eos_token_ids: tuple[int, ...] = ()


class Scheduler:
    """Runs ``runner`` over the KV in ``cache`` for submitted requests, on its own thread.

    ``detokenize(ids) -> str`` is used only to check stop strings. ``metrics`` (optional) receives
    ``on_admit(req)``, ``on_prefill(hit_tokens, new_tokens)``, ``on_first_token(seconds)``,
    ``on_inter_token(seconds)`` (the gap before each later token), ``on_pd_failure(stage)`` (a PD request
    failed while pairing, ``bootstrap``, or after, ``transfer``) and ``on_finish(req)`` on this thread.
    ``pd_mode`` ``prefill`` or ``decode`` with ``pd_transfer`` (the
    ``engine.disaggregation`` KV manager of that role) runs requests that carry a ``bootstrap`` through the PD
    queues (``engine/scheduler/pd.py``); requests without one run aggregated. ``pd_decode_offload`` (D):
    a finished PD request is cached in D's tree (prompt + answer), so HiCache's write-through backs it up to
    L3 under the same chained page keys a prefill computes for the next turn (upstream writes only the
    generated pages; here the prompt's pages are backed up again too).
    """

    def __init__(
        self,
        runner: Runner,
        cache: PrefixCache,
        device_pool,
        config: SchedulerConfig,
        detokenize,
        metrics=None,
        pd_mode: str = "null",
        pd_transfer=None,
        pd_decode_offload: bool = False,
        tp: TPSync | None = None,
    ):
        self.runner = runner
        self.tp = tp  # tensor parallelism: rank 0 hands every rank the same work (tp_sync.py)
        self.cache = cache
        self.pool = device_pool
        self.config = config
        self.metrics = metrics
        self.page_size = cache.page_size
        self.hierarchical = cache.enable_hierarchical
        self.kv = KVManager(cache)
        self.reqs: dict[str, Req] = {}
        budget = PrefillBudget(
            config.max_prefill_tokens, config.chunked_prefill_size, config.max_running_requests
        )
        self.prefill = PrefillManager(budget, self.kv, self._decode_tokens, self._on_admit)
        self.decode = DecodeManager(config.eos_token_ids, detokenize)
        self.pd: PrefillQueues | DecodeQueues | None = None
        self.output = Output(
            self.reqs,
            self.decode,
            self.prefill,
            self.kv,
            pd=lambda: self.pd,
            metrics=lambda: self.metrics,
            pd_decode_offload=pd_decode_offload,
        )
        self.sampler = BatchSampler(config.eos_token_ids, tp, self.output.abort)
        if pd_mode in ("prefill", "decode"):
            self.attach_pd(pd_mode, pd_transfer)
        self._inbox = Inbox()
        self._in_hand: object = None  # a Req, AbortReq or Command taken from the inbox, not yet fully handled
        self._accepted = 0  # requests the HTTP side holds (``accepted``); any thread, under the lock
        self._accepted_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.busy_since: float | None = None
        self.heartbeat = time.monotonic()
        self.forward_passes = 0  # completed forward passes (read by /health_generate as progress)
        self.cache_hit_rate = 0.0  # cached / prompt tokens of the last prefill batch (sglang:cache_hit_rate)
        self.state: dict = {}
        self.error: BaseException | None = None
        self._publish()

    # ----------------------------------------------------------------- API for other threads
    def start(self) -> None:
        self._thread.start()

    def run(self) -> None:
        """Run the loop on the calling thread until stopped (a tensor-parallel follower rank's main thread);
        raises what ended it."""
        self._loop()

    def stop(self) -> None:
        """Stop the loop, wait for it (pending requests are aborted), then close the cache's I/O threads."""
        self._stop.set()
        self._inbox.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        if self.pd is not None:
            self.pd.close()
        self.cache.close()

    def is_alive(self) -> bool:
        """True while the loop runs and accepts work (False from the moment it starts to shut down)."""
        return self._thread.is_alive() and self._inbox.closed is None

    def join(self, timeout: float | None = None) -> None:
        """Wait for the scheduler thread to end (crash or ``stop``); ``error`` then holds a crash's cause."""
        self._thread.join(timeout)

    def stuck_for(self) -> float:
        """Seconds the current iteration has been running (0 when the loop is waiting for work)."""
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    def submit(self, req: Req) -> None:
        """Queue ``req``; its events arrive through ``req.on_event`` (thread-safe). Once the loop has ended
        the request is finished at once with an abort whose ``status_code`` is 503."""
        if not self._inbox.put(req):
            self._reject(req)

    @contextlib.contextmanager
    def accepted(self):
        """Count one request the HTTP server has accepted, for as long as the ``with`` block runs (from
        acceptance to its last byte: body read, parsing, tokenization, bootstrap checks, submit, streaming).
        ``is_idle`` / ``require_idle`` count it, so a drain never switches roles or detaches under a
        request that has not reached the scheduler yet. Any thread."""
        with self._accepted_lock:
            self._accepted += 1
        try:
            yield
        finally:
            with self._accepted_lock:
                self._accepted -= 1

    @property
    def num_accepted(self) -> int:
        """Requests inside ``accepted`` now (HTTP requests not yet answered; they may be queued too)."""
        return self._accepted

    def abort(self, rid: str) -> None:
        """Abort a request by id (client went away); unknown ids are ignored."""
        self._inbox.put(AbortReq(rid))

    def post(self, msg: AdminMsg) -> concurrent.futures.Future:
        """Carry out the admin message ``msg`` on the scheduler thread between iterations; the future gets
        its result or error (``engine.scheduler.messages``; ``RuntimeError`` once the loop has ended)."""
        return self._command(msg)

    def call(self, fn: Callable[[Scheduler], object]) -> concurrent.futures.Future:
        """Run ``fn(scheduler)`` on the scheduler thread between iterations; the future gets its result
        (``RuntimeError`` once the loop has ended). For tests and tools that inspect the scheduler; the
        server's work goes through ``post``."""
        return self._command(fn)

    def _command(self, work: AdminMsg | Callable) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self._inbox.put(Command(work, fut)):
            fut.set_exception(RuntimeError(f"scheduler thread is not running: {self._inbox.closed}"))
        return fut

    def _reject(self, req: Req) -> None:
        refuse(req, {"type": "abort", "message": self._inbox.closed, "status_code": 503})

    # ----------------------------------------------------------------- for commands (scheduler thread)
    def is_idle(self) -> bool:
        """Nothing running, waiting, bootstrapping, transferring or waiting for KV, no chunked prefill, no
        request accepted by the HTTP server and not answered yet (``accepted``), no cache I/O in flight."""
        return not self._num_busy() and not self._accepted and self.cache.is_io_idle()

    def _num_busy(self) -> int:
        pd = len(self.pd) if self.pd is not None else 0
        return len(self.decode) + len(self.prefill) + pd

    def num_requests(self) -> int:
        """Requests running, waiting, in a PD queue or accepted by the HTTP server and not answered."""
        return self._num_busy() + self._accepted

    def require_idle(self, action: str) -> None:
        """Raise ``NotIdleError`` (upstream wording, then the counts; ``#http-req``: requests the HTTP server
        accepted and has not answered, ``accepted``) unless idle. At tp > 1 (every rank calls this at the
        same point of its loop, for an admin message) the ranks agree through an all-reduce(min): one rank
        with cache I/O in flight refuses the action on all, so none acts alone (a flush or role switch on
        some ranks only would split their caches or transports)."""
        if self.tp is not None and not self.tp.group.all_min([int(self.is_idle())])[0] and self.is_idle():
            raise NotIdleError(
                f"Reject {action}: scheduler is not idle. "
                "another tensor-parallel rank is busy (cache I/O in flight there)"
            )
        accepted = self._accepted
        if self._num_busy() or accepted:
            running = len(self.decode) + (self.prefill.chunked is not None)
            pd = f" #pd-transfer-req={len(self.pd)}" if self.pd is not None else ""
            raise NotIdleError(
                f"Reject {action}: scheduler is not idle. "
                f"#queue-req={len(self.prefill.waiting)} #running-req={running}{pd} #http-req={accepted}"
            )
        if not self.cache.is_io_idle():
            io = self.cache.inflight_io()
            raise NotIdleError(f"Reject {action}: scheduler is not idle. cache I/O in flight {io}")

    # ----------------------------------------------------------------- loop
    def _loop(self) -> None:
        progressed = True
        try:
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                if self.tp is None or self.tp.is_leader:
                    self._drain_inbox(self._wait_time(progressed))
                if self.tp is not None and self.tp.exchange(self, self._stop.is_set()):
                    self._stop.set()
                if self._stop.is_set():
                    break
                self.busy_since = time.monotonic()
                self.cache.check_hicache_events()
                progressed = self._step()
                self.forward_passes += progressed
                self.busy_since = None
                self._publish()
        except BaseException as exc:  # the thread dies; /health reports it, launch_server exits
            logger.exception("scheduler loop crashed")
            self.error = exc
            raise
        finally:
            self._close(
                "server shutting down" if self.error is None else f"scheduler crashed: {self.error!r}"
            )

    def _wait_time(self, progressed: bool) -> float | None:
        """How long to wait for new input: not at all after a forward pass, briefly while requests wait for
        cache I/O (polling without starving the I/O threads of the GIL), long when there is nothing to do."""
        if progressed:
            return None
        if self._num_busy() or not self.cache.is_io_idle():
            return 0.002
        return 0.5

    def _drain_inbox(self, timeout: float | None) -> None:
        """Take everything queued (waiting up to ``timeout`` for the first item). When requests arrived, the
        snapshot is replaced before the step that may stream their first token, so no reader that has seen
        a token can read an older snapshot that calls the worker idle."""
        took = False
        while True:
            try:
                item = self._inbox.get(timeout)
            except queue.Empty:
                item = None
            timeout = None
            if item is None:
                if took:
                    self._publish()
                return
            self._in_hand = item
            if isinstance(item, Command):
                if self.tp is not None and not callable(item.work) and not item.future.cancelled():
                    self.tp.announce(item.work, self._accepted)  # every rank carries it out, now
                self._run_command(item)
                self._publish()
            elif isinstance(item, AbortReq):
                self.output.cancel(item.rid)
                if self.tp is not None:
                    self.tp.took(item)
            else:
                assert isinstance(item, Req), f"the inbox holds requests, aborts and commands, not {item!r}"
                self.enqueue(item)
                took = True
                if self.tp is not None:
                    self.tp.took(item)
            self._in_hand = None

    def _run_command(self, cmd: Command) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        self.busy_since = time.monotonic()
        try:
            work = cmd.work
            cmd.future.set_result(work(self) if callable(work) else admin.handle(self, work))
        except Exception as exc:
            cmd.future.set_exception(exc)
        finally:
            self.busy_since = None

    def enqueue(self, req: Req) -> None:
        """Take ``req`` into the scheduler (this thread): refused at once if its id is in use or the queue is
        full, else queued (a PD request through its role's queues)."""
        if req.rid in self.reqs:
            refuse(req, {"type": "abort", "message": f"request id {req.rid!r} is already in use"})
            return
        if self._queue_full(req):
            refuse(req, {"type": "abort", "message": QUEUE_FULL, "status_code": 503})
            return
        self.reqs[req.rid] = req
        if req.bootstrap is None or self.pd is None:
            self._queue(req)
            return
        try:
            self.pd.add(req)
        except ValueError as exc:  # bad bootstrap values (the HTTP side checks them first)
            self.reqs.pop(req.rid, None)
            refuse(req, {"type": "abort", "message": str(exc), "status_code": 400})

    def _queue_full(self, req: Req) -> bool:
        """``--max-queued-requests`` (upstream): a new request is refused while that many wait to be
        prefilled. Not applied on a PD worker (upstream ignores the flag in disaggregation mode), nor to a
        health probe (it goes ahead of the queue, so a full queue never makes a busy worker look dead)."""
        limit = self.config.max_queued_requests
        waiting = len(self.prefill.waiting)
        return limit is not None and self.pd is None and not req.health_check and waiting >= limit

    def _queue(self, req: Req) -> None:
        """Into the prefill queue (a health probe goes first); an L3 prefetch of its prefix starts now."""
        self.prefill.add(req)

    def run_admin_for_leader(self, msg, accepted: int):
        """A TP follower rank carries out rank 0's admin message ``msg`` (:mod:`engine.scheduler.admin`) with
        rank 0's count of HTTP requests in hand, ``accepted``, so idle checks decide as rank 0's did."""
        self._accepted = accepted
        try:
            return admin.handle(self, msg)
        finally:
            self._accepted = 0

    def detach_pd(self) -> None:
        """Close the PD queues and their transfer manager; the worker has no PD role until
        :meth:`attach_pd`."""
        if self.pd is not None:
            self.pd.close()
        self.pd = None

    def attach_pd(self, role: str, mgr) -> None:
        """Run PD requests through the queues of ``role`` (``prefill`` / ``decode``) over the transfer
        manager ``mgr``; they reach the scheduler only through ``PDHooks``."""
        hooks = PDHooks(
            page_size=self.page_size,
            get=self.reqs.get,
            queue=self._queue,
            unqueue=self.prefill.unqueue,
            reserve=self.kv.reserve,
            start_decoding=self._start_decoding,
            finish=lambda req, reason, last_ids: self.output.finish(req, reason, last_ids, insert=False),
            on_failure=self._on_pd_failure,
            agree=self.tp.group.all_min if self.tp is not None else list,
        )
        self.pd = make_queues(role, hooks, mgr)

    def _on_admit(self, req: Req) -> None:
        if self.metrics:  # ``metrics`` may be set after construction
            self.metrics.on_admit(req)

    def _on_pd_failure(self, stage: str) -> None:
        if self.metrics:
            self.metrics.on_pd_failure(stage)

    def _step(self) -> bool:
        """One scheduling decision; True when a forward pass ran or a PD request moved."""
        moved = self.pd.poll() if self.pd is not None else False
        items = self.prefill.schedule(len(self.decode))
        if items:
            self._run_prefill(items)
            return True
        if self.decode:
            self._run_decode()
            return True
        if self.hierarchical:  # no forward pass this time: start loads queued by a failed admission
            self.cache.ready_to_load_host_cache()
        return moved

    # ----------------------------------------------------------------- prefill
    def _decode_tokens(self, req: Req) -> int:
        """Positions admission reserves past the prompt: none when the KV goes to a decode worker."""
        return 0 if self._sends_kv(req) else req.params.max_new_tokens

    def _run_prefill(self, items: list[tuple[Req, int, int]]) -> None:
        batch_reqs = [r for r, _, _ in items]
        timed = True  # the pass's time is the cost of computing its new tokens: no load-back waited in it
        for req in batch_reqs:
            if req.state is ReqState.LOADING:  # the forward pass waits for its load-back layer by layer
                req.move(ReqState.PREFILLING)
                timed = False
        began = time.perf_counter()
        try:
            batch = ForwardBatch.from_sequences(
                [r.fill_ids[s:e] for r, s, e in items],
                [r.lease.indices[:e] for r, _, e in items],
                self.cache.wait_layer if self.hierarchical else None,
                self.pool.device,
            )
            if any(r.mm_items for r in batch_reqs):
                ranges = [(r.mm_items, s, e) for r, s, e in items]
                batch.mm_embeds = batch_embeds(ranges)
                batch.mrope_positions = mrope_positions(ranges)
            wants_rows = any(prompt_rows(r, s, e) for r, s, e in items)
            logits = self._forward(batch, return_all_logits=wants_rows)
            if wants_rows:
                logits = read_prompt_logprobs(items, logits)
        except Exception as exc:
            logger.exception("prefill forward failed")
            self.prefill.chunked = None
            self.output.abort_all(batch_reqs, f"forward failed: {exc}")
            return
        new_tokens = sum(e - s for _, s, e in items)
        if timed and self.pool.device.type == "cpu":  # on an accelerator: timed after sampling (below)
            self.cache.stats.costs.observe("prefill", new_tokens, time.perf_counter() - began)
            timed = False
        hit = sum(r.cached_tokens for r, s, _ in items if s == r.cached_tokens)
        self.cache_hit_rate = hit / (hit + new_tokens) if hit + new_tokens else 0.0
        done: list[tuple[int, Req]] = []
        for i, (req, _, end) in enumerate(items):
            req.lease.num_computed = end
            if end < len(req.input_ids):
                self._per_request(req, "prefill", self.kv.cache_prefix, req.kv, req.fill_ids, chunked=True)
            else:
                done.append((i, req))
        if not done:
            return
        reqs = [r for _, r in done]
        tokens = self.sampler.sample(logits[[i for i, _ in done]], reqs)
        if timed:  # the sampled tokens are on the host: the pass has finished on the device
            self.cache.stats.costs.observe("prefill", new_tokens, time.perf_counter() - began)
        for req, tok in zip(reqs, tokens, strict=True):
            if tok is not None:
                self._per_request(req, "prefill", self._prompt_done, req, tok)

    def _sends_kv(self, req: Req) -> bool:
        return req.bootstrap is not None and self.pd is not None and self.pd.sends_kv

    def _prompt_done(self, req: Req, tok: int) -> None:
        """After the prompt's last chunk, the one decision point: cache the prompt's prefix, then hand its KV
        and ``tok`` to D (a PD request on P), finish it (``max_new_tokens`` 0) or decode it here."""
        if req.aborted:
            self.output.finish(req, {"type": "abort", "message": req.aborted})
            return
        self.kv.cache_prefix(req.lease, req.fill_ids)
        if self._sends_kv(req):
            assert isinstance(self.pd, PrefillQueues), "only P's queues send KV"
            self.pd.send(req, tok)
            return
        if req.params.max_new_tokens == 0:
            self.output.finish(req, {"type": "length", "length": 0})
            return
        req.move(ReqState.DECODING)
        self._start_decoding(req, tok)

    # ----------------------------------------------------------------- decode
    def _start_decoding(self, req: Req, tok: int) -> None:
        """``req`` (DECODING) joins the decode set with its first token ``tok``."""
        self.decode.add(req)
        self.output.append_token(req, tok)

    def _run_decode(self) -> None:
        reqs = self.decode.batch()
        try:
            batch = ForwardBatch.for_decode(
                [r.output_ids[-1] for r in reqs],
                [r.lease.indices[: r.lease.num_computed + 1] for r in reqs],
                self.cache.wait_layer if self.hierarchical else None,
                self.pool.device,
                seq_keys=[r.kv for r in reqs],  # a request's lease: the KV it owns, new per admission
            )
            if any(r.mm_items for r in reqs):  # M-RoPE: text after an image sits at a shifted position
                n = [r.lease.num_computed + 1 for r in reqs]
                batch.mrope_positions = mrope_positions(
                    [(r.mm_items, k - 1, k) for r, k in zip(reqs, n, strict=True)]
                )
            logits = self._forward(batch)
        except Exception as exc:
            logger.exception("decode forward failed")
            self.output.abort_all(reqs, f"forward failed: {exc}")
            return
        for req in reqs:
            req.lease.num_computed += 1
        tokens = self.sampler.sample(logits, reqs)
        for req, tok in zip(reqs, tokens, strict=True):
            if tok is None:
                continue
            if req.aborted:
                reason = {"type": "abort", "message": req.aborted}
                self._per_request(req, "decode", self.output.finish, req, reason)
            else:
                self._per_request(req, "decode", self.output.append_token, req, tok)

    def _per_request(self, req: Req, stage: str, fn: Callable, *args, **kwargs):
        """Run ``fn`` for one request; if it raises, abort only that request (its KV freed, its tree lock
        dropped, nothing inserted) and return None, so one bad request never stops the scheduler."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            logger.exception("request %s failed in %s", req.rid, stage)
            self.output.abort(req, f"{stage} failed: {exc}")
            return None

    def _forward(self, batch: ForwardBatch, return_all_logits: bool = False) -> torch.Tensor:
        """One forward pass (queued L2 load-backs started first); last-position logits ``(B, V)``, or every
        position's ``(T, V)`` with ``return_all_logits``."""
        if self.hierarchical:
            self.cache.ready_to_load_host_cache()
        if return_all_logits:
            return self.runner.forward(batch, self.pool, return_all_logits=True)
        return self.runner.forward(batch, self.pool)

    # ----------------------------------------------------------------- close
    def _close(self, message: str) -> None:
        """The loop is ending: refuse new work, then fail every known request, queued request and command
        (aborts carry ``status_code`` 503, the worker is unavailable)."""
        items = [*self.reqs.values(), self._in_hand, *self._inbox.close(message)]
        self.reqs.clear()
        for item in items:
            if isinstance(item, Req) and not item.finished:
                self._reject(item)
            elif isinstance(item, Command) and not item.future.done():
                item.future.set_exception(RuntimeError(f"scheduler thread is not running: {message}"))

    # ----------------------------------------------------------------- reporting
    def _publish(self) -> None:
        """Replace the snapshot other threads read (one assignment: readers never see a partial one)."""
        self.state = snapshot(
            self.cache,
            self.pool.size,
            running=len(self.decode) + (self.prefill.chunked is not None),
            waiting=len(self.prefill.waiting),
            pd_transfer=len(self.pd) if self.pd is not None else 0,
            pd_queues=self.pd.queue_sizes() if self.pd is not None else {},
            http=self._accepted,
            idle=self.is_idle(),
            cache_hit_rate=self.cache_hit_rate,
        )
