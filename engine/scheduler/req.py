"""One generation request as the scheduler tracks it, its state machine, and the events it sends back."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.model.vlm.mm import MMItem
from engine.scheduler.kv_manager import KVLease
from engine.scheduler.logprobs import LogprobState
from engine.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.cache.misses import Misses
    from engine.grammar.state import GrammarState
    from engine.scheduler.request import GenerateRequest


class ReqState(enum.Enum):
    """Where a request is in its life. Aggregated: queued [-> prefetching] -> loading|prefilling -> decoding
    -> finished. Prefill server (P): queued -> bootstrapping -> queued|prefetching -> ... -> prefilling ->
    transferring -> finished. Decode server (D): queued -> bootstrapping -> waiting_for_kv -> decoding ->
    finished. Any state that is not final may end in aborted."""

    QUEUED = "queued"  # in the waiting queue
    PREFETCHING = "prefetching"  # in the waiting queue while an L3 -> L2 prefetch runs
    LOADING = "loading"  # admitted; its L2 prefix is being loaded back into L1
    PREFILLING = "prefilling"  # admitted; its prompt is being computed (possibly in chunks)
    DECODING = "decoding"  # generating tokens
    BOOTSTRAPPING = "bootstrapping"  # PD: P and D are pairing up for this request
    TRANSFERRING = "transferring"  # PD, on P: the prompt's KV is on its way to D
    WAITING_FOR_KV = "waiting_for_kv"  # PD, on D: slots reserved, KV pending
    FINISHED = "finished"
    ABORTED = "aborted"


S = ReqState
TRANSITIONS: dict[ReqState, frozenset[ReqState]] = {
    S.QUEUED: frozenset({S.PREFETCHING, S.LOADING, S.PREFILLING, S.BOOTSTRAPPING, S.ABORTED}),
    S.BOOTSTRAPPING: frozenset({S.QUEUED, S.PREFETCHING, S.WAITING_FOR_KV, S.ABORTED}),
    S.PREFETCHING: frozenset({S.LOADING, S.PREFILLING, S.ABORTED}),
    S.LOADING: frozenset({S.PREFILLING, S.ABORTED}),
    S.PREFILLING: frozenset({S.DECODING, S.TRANSFERRING, S.FINISHED, S.ABORTED}),
    S.DECODING: frozenset({S.FINISHED, S.ABORTED}),
    S.TRANSFERRING: frozenset({S.FINISHED, S.ABORTED}),
    S.WAITING_FOR_KV: frozenset({S.DECODING, S.FINISHED, S.ABORTED}),
    S.FINISHED: frozenset(),
    S.ABORTED: frozenset(),
}
del S


class IllegalTransition(RuntimeError):
    """A request was moved along an edge the transition table does not have (a scheduler bug)."""


@dataclass(frozen=True)
class Bootstrap:
    """A PD request's pairing, as the router injects it: P's host and bootstrap port, and the room (a 63-bit
    id both P and D use for this request)."""

    host: str
    port: int
    room: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class ReqOutput:
    """What the scheduler reports after a step: the new token ids, and at the end the finish reason.

    ``finish_reason`` follows SGLang's meta_info: ``{"type": "length", "length": n}``,
    ``{"type": "stop", "matched": <token id or stop string>}`` or ``{"type": "abort", "message": str}``.
    ``meta`` is filled on the first event (cache hit counts) and the last one (latencies). ``logprobs``
    (requests that asked for them): the entries new since the previous event,
    ``{"input": LogprobValues, "output": LogprobValues}`` (``engine.scheduler.logprobs``).
    """

    rid: str
    new_ids: list[int]
    finished: bool = False
    finish_reason: dict | None = None
    meta: dict = field(default_factory=dict)
    logprobs: dict | None = None


@dataclass(eq=False)
class Req:
    """Scheduler-side state of one request.

    ``state`` changes only through ``move`` (checked against ``TRANSITIONS``). ``kv`` is the L1 KV the request
    holds from admission to release (see ``KVLease``). ``bootstrap`` is set for a PD request. ``aborted`` is
    set when the client goes away while the request is in a batch or a PD queue (it is then finished at the
    next step). ``on_event`` is called on the scheduler thread and must only hand the event over.
    ``cache_salt``: the request's cache key space (requests with different salts share no cached KV; None:
    the shared space). ``logprob``: the log-probabilities it asked for and those computed so far (None:
    none asked). ``grammar``: the matcher of a constrained request (its vocab mask is applied before
    each sampling, and it is advanced by each token appended). ``request``: the ``GenerateRequest`` it was
    built of (``GenerateRequest.to_req``; None for a ``Req`` built directly), which a tensor-parallel rank 0
    hands to the other ranks (``tp_sync.py``).
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_event: Callable[[ReqOutput], object]  # its result is ignored
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.QUEUED
    kv: KVLease | None = None
    bootstrap: Bootstrap | None = None
    cached: dict = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    misses: Misses | None = None  # why the other prompt tokens were computed (engine/cache/misses.py)
    aborted: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    generator: torch.Generator | None = None
    health_check: bool = False  # a /health_generate probe: queued ahead of user requests
    cache_salt: str | None = field(default=None, repr=False)  # a tenant's secret: never logged
    mm_items: list[MMItem] = field(default_factory=list, repr=False)  # images: token ranges + embeddings
    logprob: LogprobState | None = None
    grammar: GrammarState | None = field(default=None, repr=False)  # constrained decoding (engine/grammar)
    request: GenerateRequest | None = field(default=None, repr=False)  # what it was built of (``to_req``)

    def move(self, state: ReqState) -> None:
        """Go to ``state``; raises ``IllegalTransition`` when the table has no such edge."""
        if state not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.rid!r}: {self.state.value} -> {state.value}")
        self.state = state

    @property
    def lease(self) -> KVLease:
        """``kv`` of a request that holds its KV (admitted and not yet released: prefilling, decoding, in a
        PD transfer); an ``AssertionError`` otherwise."""
        assert self.kv is not None, f"request {self.rid!r} holds no KV in state {self.state.value}"
        return self.kv

    @property
    def finished(self) -> bool:
        """Finished or aborted (a final state)."""
        return self.state in (ReqState.FINISHED, ReqState.ABORTED)

    @property
    def fill_ids(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return self.input_ids + self.output_ids

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from any cache tier."""
        return self.cached["device"] + self.cached["host"] + self.cached["storage"]
