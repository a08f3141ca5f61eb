"""Keeping the schedulers of a tensor-parallel group in step (upstream: rank 0 broadcasts what it received).

Rank 0 (the leader) owns the HTTP server and the inbox. Each iteration, after draining its inbox, it
broadcasts what it took in (new requests, each as the ``GenerateRequest`` the routes built, so every rank
gets the same prompt, parameters, salt, images, log-probabilities and PD pairing; aborts; admin messages it
carried out) and whether it is stopping;
every other rank (a follower, no inbox) applies the same items in the same order, so all ranks hold the same
queues and take the same scheduling decisions. Rank 0's sampled tokens are broadcast too, so every rank
appends the same token whatever its sampler would have drawn (upstream's ``SYNC_TOKEN_IDS_ACROSS_TP``).
Cache decisions that depend on I/O timing agree through the cache's own all-reduce(min) (``engine/cache``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, cast

from engine.distributed import TPGroup
from engine.scheduler.messages import AbortReq, AttachStorage, SwitchRole
from engine.scheduler.req import Req, ReqOutput
from engine.scheduler.request import GenerateRequest

logger = logging.getLogger(__name__)


class _Cancels(Protocol):
    def cancel(self, rid: str) -> None: ...


class TPFollower(Protocol):
    """What a follower rank's items need of its scheduler."""

    @property
    def output(self) -> _Cancels: ...

    def enqueue(self, req: Req) -> None: ...

    def run_admin_for_leader(self, msg: object, accepted: int) -> object: ...


def shared(req: Req) -> GenerateRequest:
    """What rank 0 hands the other ranks of a request it received: the ``GenerateRequest`` the ``Req`` was
    built of (``GenerateRequest.to_req``, so ``req.request`` is set) with the ``rid`` rank 0 gave it and no
    compiled grammar (it does not pickle; each rank compiles its own: ``follower_req``)."""
    assert req.request is not None, f"request {req.rid!r} was not built by GenerateRequest.to_req"
    return replace(req.request, rid=req.rid, grammar=None)


def follower_req(request: GenerateRequest, grammar=None) -> Req:
    """The request on a follower, of what ``shared`` sent: no client (rank 0 answers it); with its
    ``GrammarBackend`` ``grammar``, a constrained request gets its own matcher (compiled here, cached: rank 0
    compiled it before submitting), so every rank ends it when its grammar does."""
    constraint = request.params.constraint
    if grammar is not None and constraint is not None:
        request = replace(request, grammar=grammar.compile(*constraint).result())
    return request.to_req(_discard)


@dataclass(frozen=True)
class _Admin:
    """An admin message every rank carries out, with rank 0's count of HTTP requests in hand."""

    msg: object
    accepted: int


def _discard(_: ReqOutput) -> None:
    """A follower's requests have no client: rank 0 answers them."""


class TPSync:
    """One rank's side of the per-iteration exchange; ``group.is_leader`` picks the side."""

    def __init__(self, group: TPGroup, grammar=None, make_transfer: Callable | None = None) -> None:
        self.group = group
        self.grammar = grammar  # a follower's GrammarBackend (engine/grammar), for constrained requests
        # a follower's ``make_transfer(role)`` (its own pool): builds its transport on a role switch
        self.make_transfer = make_transfer
        self._taken: list[object] = []

    @property
    def is_leader(self) -> bool:
        return self.group.is_leader

    # -- leader
    def took(self, item: object) -> None:
        """Rank 0 took ``item`` from its inbox and handled it (a ``Req`` or an ``AbortReq``)."""
        self._taken.append(shared(item) if isinstance(item, Req) else item)

    def announce(self, msg: object, accepted: int) -> None:
        """Rank 0 is about to carry out the admin message ``msg``: every rank carries it out now, in the same
        place in its loop (admin work may take part in the cache's collectives). ``accepted``: rank 0's HTTP
        requests in hand, which its idle checks count, so the other ranks' checks decide the same."""
        if isinstance(msg, AttachStorage) and not isinstance(msg.backend, str):
            # a backend rank 0 prepared off its scheduler thread: each rank opens its own by name
            name = getattr(msg.backend, "name", None) or type(msg.backend).__name__
            extra, backend_extra = msg.extra_config, getattr(msg.backend, "extra", None)
            if extra is None and backend_extra:
                extra = json.dumps(backend_extra)
            msg = AttachStorage(name, extra, msg.prefetch_policy, msg.write_policy)
        elif isinstance(msg, SwitchRole):
            msg = replace(msg, make_transfer=None)  # rank 0's builder holds its pool: each rank has its own
        self.group.broadcast_object(("more", False, [*self._taken, _Admin(msg, accepted)]))
        self._taken = []

    # -- both
    def exchange(self, sched: TPFollower, stopping: bool) -> bool:
        """Broadcast (rank 0) or receive and apply (the others) this iteration's items; True when the group
        stops. Raises what ``torch.distributed`` raises when a rank is gone."""
        if self.is_leader:
            self.group.broadcast_object(("end", stopping, self._taken))
            self._taken = []
            return stopping
        while True:
            frame = cast(tuple[str, bool, list], self.group.broadcast_object(None))  # rank 0's, sent above
            kind, stop, items = frame
            for item in items:
                if isinstance(item, GenerateRequest):
                    sched.enqueue(follower_req(item, self.grammar))
                elif isinstance(item, AbortReq):
                    sched.output.cancel(item.rid)
                elif isinstance(item, _Admin):
                    self._run_admin(sched, item)
            if kind == "end":
                return stop

    def _run_admin(self, sched: TPFollower, item: _Admin) -> None:
        msg = item.msg
        if isinstance(msg, SwitchRole):
            msg = replace(msg, make_transfer=self.make_transfer)
        try:
            sched.run_admin_for_leader(msg, item.accepted)
        except Exception as exc:  # rank 0 answers the client; its own outcome is the one reported
            logger.info("tp rank %d: admin message %r: %s", self.group.rank, item.msg, exc)

    def tokens(self, tokens: list[int | None]) -> list[int | None]:
        """Rank 0's sampled tokens on every rank."""
        return self.group.broadcast_object(tokens)  # type: ignore[return-value]
