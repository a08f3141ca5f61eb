"""Prefill/decode disaggregation in the scheduler: the queues a PD request passes through on P and on D.

After SGLang's ``disaggregation/prefill.py`` and ``decode.py`` (one rank, no DP attention). Both run on the
scheduler thread, poll the transport's rooms (``engine.disaggregation``: ``KVSender`` / ``KVReceiver``) once
per iteration and never block.

* P (``PrefillQueues``): a request opens a sender for its ``bootstrap_room`` and waits in ``bootstrapping``
  until D has said where its KV goes (``WaitingForInput``); then it joins the waiting queue and is prefilled
  as any request (full HiCache: L1/L2 hits, L3 prefetch). After its prompt, ``send`` hands its KV pages, the
  first token and its per-tier cached tokens to the sender; it waits in ``transferring`` for ``Success``
  (finished) or ``Failed`` (aborted). Its pages stay leased (and its prefix locked) until then.
* D (``DecodeQueues``): a request opens a receiver (resolving P happens on the transport's threads) and
  waits in ``prealloc`` until L1 has room for prompt + ``max_new_tokens``; those pages are reserved with no
  prefix ("slots reserved, KV pending") and the prompt's pages go to the receiver; it waits in
  ``waiting_kv`` until ``Success`` (then it decodes, starting from P's first token; it is never prefilled
  here) or ``Failed`` (aborted, with the transport's reason naming P's bootstrap address).

An abort (client gone) tells the peer and ends the request once the room is terminal, so no late write can
land in pages that were already freed. On P a paired request whose room fails before its prompt is done (D
aborted it, or it passed the waiting timeout: D went away) ends at once, queued or part-way through a
chunked prefill, with its pages and prefix lock released. Each PD request that fails (not a client abort)
is counted in upstream's ``num_bootstrap_failed_reqs`` / ``num_transfer_failed_reqs`` and its reason is
logged.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.cache.misses import Misses
from engine.disaggregation import KVPoll, KVReceiver, KVSender
from engine.disaggregation.common import bootstrap_address
from engine.scheduler.kv_manager import KVLease
from engine.scheduler.logprobs import LogprobValues, from_wire, run_from_wire, run_to_wire, to_wire
from engine.scheduler.req import Req, ReqState

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PDHooks:
    """Everything the PD queues may ask of the scheduler (called on its thread).

    ``get(rid)``: the live request of that id, or None. ``queue(req)`` (P): a paired request joins the
    prefill queue. ``unqueue(req)`` (P): take a waiting request out of it (False if it was not waiting).
    ``reserve(rid, positions, salt)`` (D): L1 pages with no prefix in the request's cache key space
    (``KVManager.reserve``). ``start_decoding(req,
    tok)`` (D): ``req`` decodes from P's first token ``tok``. ``finish(req, reason, last_ids)``: end ``req``
    (its KV released, nothing inserted) and send its last event. ``on_failure(stage)``: a PD request failed,
    ``bootstrap`` or ``transfer`` (metrics).
    """

    page_size: int
    get: Callable[[str], Req | None]
    queue: Callable[[Req], None]
    unqueue: Callable[[Req], bool]
    reserve: Callable[[str, int, str | None], KVLease | None]
    start_decoding: Callable[[Req, int], None]
    finish: Callable[[Req, dict, list[int] | None], None]
    on_failure: Callable[[str], None]
    agree: Callable[[list[int]], list[int]] = list


OTHER_RANK = "the transfer of another tensor-parallel rank of this worker failed (its log has the reason)"


def _agreed(hooks: PDHooks, rooms: dict) -> dict[str, tuple[KVPoll, bool]]:
    """rid -> (the lowest state of the request's room over the ranks, whether it is terminal on every
    rank). Each rank polls its own room (its share of the KV heads); the ranks hold the same rooms in the
    same order, so one all-reduce(min) per poll lets them all take the same decision. Failed (0) is the
    lowest state: one rank's failure fails the request everywhere."""
    rids = list(rooms)
    if not rids:
        return {}
    local: list[int] = []
    for rid in rids:
        state = rooms[rid].poll()
        local += [int(state), int(state in (KVPoll.Success, KVPoll.Failed))]
    agreed = hooks.agree(local)
    return {rid: (KVPoll(agreed[2 * i]), bool(agreed[2 * i + 1])) for i, rid in enumerate(rids)}


def _why(room) -> str:
    """The failure reason of ``room`` on this rank, or ``OTHER_RANK`` when only another rank's failed."""
    with room.lock:
        failed = room.reason is not None
    return str(room.failure_exception()) if failed else OTHER_RANK


def _pages(n: int, page_size: int) -> int:
    return -(-n // page_size)


def _failed(hooks: PDHooks, req: Req, reason: str, status_code: int = 500) -> dict:
    """The abort finish reason of a PD request whose room failed (``status_code`` 400 when D refused the
    request, else 500); counted and logged unless the client aborted it (the metric's stage: ``bootstrap``
    while still pairing, else ``transfer``)."""
    if not req.aborted:
        stage = "bootstrap" if req.state is ReqState.BOOTSTRAPPING else "transfer"
        logger.warning("PD request %s failed (%s): %s", req.rid, stage, reason)
        hooks.on_failure(stage)
    return {"type": "abort", "message": reason, "status_code": status_code}


class PrefillQueues:
    """P's bootstrap and transfer queues over ``mgr`` (a ``PrefillTransfer``), talking to the scheduler
    through ``hooks``."""

    sends_kv = True  # a PD request's KV leaves this worker after its prompt

    def __init__(self, hooks: PDHooks, mgr) -> None:
        self.hooks = hooks
        self.mgr = mgr
        self.bootstrapping: list[Req] = []
        self.transferring: list[Req] = []
        self.rooms: dict[str, KVSender] = {}

    def __len__(self) -> int:
        return len(self.bootstrapping) + len(self.transferring)

    def queue_sizes(self) -> dict[str, int]:
        """Requests per queue, by upstream's /v1/loads names (``prefill_bootstrap_queue_reqs``: pairing with
        their decode; ``prefill_inflight_queue_reqs``: prefilled, KV on its way)."""
        return {
            "prefill_bootstrap_queue_reqs": len(self.bootstrapping),
            "prefill_inflight_queue_reqs": len(self.transferring),
        }

    def add(self, req: Req) -> None:
        """A new request from the router: open its room; it is prefilled once D is paired (it fails at once
        when its bootstrap address names another prefill: it was sent here as its decode)."""
        b = req.bootstrap
        assert b is not None, "the PD queues take only PD requests (bootstrap set)"
        sender = self.mgr.create_sender(b.room, bootstrap_address(b.host, b.port))
        self.rooms[req.rid] = sender
        sender.init(_pages(len(req.input_ids), self.hooks.page_size))
        req.move(ReqState.BOOTSTRAPPING)
        self.bootstrapping.append(req)

    def send(self, req: Req, tok: int) -> None:
        """The prompt is computed and cached: hand its pages, first token and cached tokens to D."""
        lease, page = req.kv, self.hooks.page_size
        assert lease is not None, f"{req.rid}: a prefilled request holds its KV lease"
        n = _pages(len(req.input_ids), page)
        meta = {
            "prompt_tokens": len(req.input_ids),
            "cached_tokens": req.cached_tokens,
            "cached_tokens_details": dict(req.cached),
        }
        if req.misses is not None:  # D reports P's attribution (D itself matched nothing)
            meta["miss_tokens_details"] = req.misses.meta()
        if req.logprob is not None:  # the prompt's and the first token's log-probabilities: D reports them
            meta["first_token_logprobs"] = to_wire(req.logprob.output, 0)
            meta["input_logprobs"] = run_to_wire(req.logprob.input)
        if req.generator is not None:  # a seeded request: D draws on from where P's first draw left it
            meta["generator_state"] = base64.b64encode(req.generator.get_state().numpy().tobytes()).decode()
        req.output_ids.append(tok)
        req.move(ReqState.TRANSFERRING)
        self.transferring.append(req)
        self.rooms[req.rid].send(lease.indices[: n * page : page] // page, first_token_id=tok, meta=meta)

    def abort(self, req: Req) -> None:
        req.aborted = "aborted"
        self.rooms[req.rid].abort("aborted by prefill")

    def poll(self) -> bool:
        """Move paired requests to the waiting queue and end finished transfers; True if anything moved.
        Decisions follow the state the ranks agree on (``_agreed``)."""
        moved = False
        agreed = _agreed(self.hooks, self.rooms)
        for req in list(self.bootstrapping):
            state = agreed[req.rid][0]
            if state == KVPoll.Failed or req.aborted:
                self.bootstrapping.remove(req)
                self._end(req, state)
                moved = True
            elif state >= KVPoll.WaitingForInput:
                self.bootstrapping.remove(req)
                req.move(ReqState.QUEUED)
                self.hooks.queue(req)
                moved = True
        for req in list(self.transferring):
            state = agreed[req.rid][0]
            if state in (KVPoll.Success, KVPoll.Failed):
                self.transferring.remove(req)
                self._end(req, state)
                moved = True
        return self._end_unpaired(agreed) or moved

    def _end_unpaired(self, agreed: dict[str, tuple[KVPoll, bool]]) -> bool:
        """End the paired requests still on P (queued, or part-way through a chunked prefill) whose room
        failed meanwhile: nothing will take their KV, so they give back their pages and prefix lock now."""
        hooks, moved = self.hooks, False
        for rid, sender in list(self.rooms.items()):
            req = hooks.get(rid)
            if req is None or req.state in (ReqState.BOOTSTRAPPING, ReqState.TRANSFERRING):
                continue
            if agreed[rid][0] != KVPoll.Failed:
                continue
            hooks.unqueue(req)
            if sender.poll() != KVPoll.Failed:  # another rank's room failed: this rank's sends nothing
                sender.abort(OTHER_RANK)
            reason = req.aborted or _why(sender)
            hooks.finish(req, _failed(hooks, req, reason, sender.status_code), None)  # closes it (``drop``)
            moved = True
        return moved

    def _end(self, req: Req, state: KVPoll) -> None:
        """End ``req`` whose room the ranks agree is ``state`` (Success: its KV reached D everywhere)."""
        sender = self.rooms.pop(req.rid)
        if state == KVPoll.Success:
            reason = {"type": "length", "length": len(req.output_ids)}
            self.hooks.finish(req, reason, req.output_ids[-1:])
        else:
            if sender.poll() not in (KVPoll.Failed, KVPoll.Success):
                sender.abort("aborted by prefill")
            why = req.aborted or _why(sender)
            self.hooks.finish(req, _failed(self.hooks, req, why, sender.status_code), None)
        sender.close()

    def drop(self, req: Req) -> None:
        """The request ended outside these queues (aborted while queued, a failed forward pass): fail and
        close its room so D is told at once."""
        sender = self.rooms.pop(req.rid, None)
        if sender is not None:
            sender.abort(req.aborted or "prefill request aborted")
            sender.close()

    def close(self) -> None:
        self.mgr.close()


class DecodeQueues:
    """D's prealloc and transfer queues over ``mgr`` (a ``DecodeTransfer``), talking to the scheduler
    through ``hooks``."""

    sends_kv = False

    def __init__(self, hooks: PDHooks, mgr) -> None:
        self.hooks = hooks
        self.mgr = mgr
        self.prealloc: list[Req] = []
        self.waiting_kv: list[Req] = []
        self.rooms: dict[str, KVReceiver] = {}

    def __len__(self) -> int:
        return len(self.prealloc) + len(self.waiting_kv)

    def queue_sizes(self) -> dict[str, int]:
        """Requests per queue, by upstream's /v1/loads names (``decode_prealloc_queue_reqs``: pairing and
        reserving KV slots; ``decode_transfer_queue_reqs``: waiting for the prompt's KV)."""
        return {
            "decode_prealloc_queue_reqs": len(self.prealloc),
            "decode_transfer_queue_reqs": len(self.waiting_kv),
        }

    def add(self, req: Req) -> None:
        """A new request from the router: open its room toward P's bootstrap server."""
        b = req.bootstrap
        assert b is not None, "the PD queues take only PD requests (bootstrap set)"
        self.rooms[req.rid] = self.mgr.create_receiver(b.host, b.port, b.room)
        req.move(ReqState.BOOTSTRAPPING)
        self.prealloc.append(req)

    def abort(self, req: Req) -> None:
        req.aborted = "aborted"
        self.rooms[req.rid].abort("aborted by decode")

    def poll(self) -> bool:
        """Reserve pages for requests in arrival order while L1 has room, and start decoding requests whose
        KV has landed; True if anything moved."""
        moved = False
        hooks = self.hooks
        agreed = _agreed(hooks, self.rooms)
        for req in list(self.prealloc):
            receiver = self.rooms[req.rid]
            state = agreed[req.rid][0]
            if state == KVPoll.Failed:  # no pages reserved yet: closing the room ends it on every rank
                self.prealloc.remove(req)
                self._fail(req)
                moved = True
                continue
            if req.aborted:
                continue  # its room turns Failed once P acknowledged the abort
            lease = hooks.reserve(req.rid, len(req.input_ids) + req.params.max_new_tokens, req.cache_salt)
            if lease is None:
                break  # no room yet: later requests wait behind this one
            req.kv = lease
            page = hooks.page_size
            n = _pages(len(req.input_ids), page)
            receiver.init(lease.indices[: n * page : page] // page)
            req.move(ReqState.WAITING_FOR_KV)
            self.prealloc.remove(req)
            self.waiting_kv.append(req)
            moved = True
        for req in list(self.waiting_kv):
            receiver = self.rooms[req.rid]
            state, everywhere = agreed[req.rid]
            if state == KVPoll.Failed and not everywhere:
                # another rank's room failed: stop this rank's, and free the pages only once no write can
                # land in them any more (every rank's room terminal)
                receiver.abort(OTHER_RANK)
            elif state == KVPoll.Failed:
                self.waiting_kv.remove(req)
                self._fail(req)
                moved = True
            elif state == KVPoll.Success and req.aborted:
                self.waiting_kv.remove(req)
                self.rooms.pop(req.rid).close()
                hooks.finish(req, {"type": "abort", "message": req.aborted}, None)
                moved = True
            elif state == KVPoll.Success:
                self.waiting_kv.remove(req)
                self.rooms.pop(req.rid).close()
                self._start_decoding(req, receiver)
                moved = True
        return moved

    def _start_decoding(self, req: Req, receiver) -> None:
        """The prompt's KV is in the reserved pages: decode from P's first token."""
        assert req.kv is not None, f"{req.rid}: pages were reserved before the KV was awaited"
        req.kv.num_computed = len(req.input_ids)
        details = (receiver.meta or {}).get("cached_tokens_details") or {}
        req.cached = {tier: int(details.get(tier, 0)) for tier in ("device", "host", "storage")}
        misses = (receiver.meta or {}).get("miss_tokens_details")
        if isinstance(misses, dict):
            req.misses = Misses.from_meta(misses)
        req.admitted_at = req.admitted_at or req.arrival
        if req.logprob is not None:  # D computes no prompt rows: P's come with the KV
            sent = (receiver.meta or {}).get("input_logprobs")
            req.logprob.input = LogprobValues() if sent is None else run_from_wire(sent)
            first = (receiver.meta or {}).get("first_token_logprobs")
            if first is not None:
                req.logprob.output.extend(from_wire(first))
        state = (receiver.meta or {}).get("generator_state")
        if state is not None and req.generator is not None:
            req.generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))
        req.move(ReqState.DECODING)
        self.hooks.start_decoding(req, int(receiver.first_token_id))

    def _fail(self, req: Req) -> None:
        receiver = self.rooms.pop(req.rid)
        reason = req.aborted or _why(receiver)
        receiver.close()
        self.hooks.finish(req, _failed(self.hooks, req, reason), None)

    def drop(self, req: Req) -> None:
        """Nothing to do: a D request leaves these queues only with its room closed."""

    def close(self) -> None:
        self.mgr.close()


def make_queues(role: str, hooks: PDHooks, mgr) -> PrefillQueues | DecodeQueues:
    """The PD queues of ``role`` (``prefill`` / ``decode``) over the transfer manager ``mgr``."""
    return PrefillQueues(hooks, mgr) if role == "prefill" else DecodeQueues(hooks, mgr)
