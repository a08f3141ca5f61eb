"""One generation request as the HTTP side hands it to the engine: ``GenerateRequest``.

The routes (``/generate``: ``engine/server/generate.py``; ``/v1/completions`` and ``/v1/chat/completions``:
``engine/server/openai.py``; the ``/health_generate`` probe: ``engine/server/info.py``) build one per prompt,
once, after checking the body; ``Engine.stream`` / ``generate`` / ``generate_n`` / ``prefill_once``
(``engine/server/engine.py``) carry it whole, and ``to_req`` makes the scheduler's ``Req`` of it. It holds
what the client asked for, already checked and resolved (token ids, not text; a compiled grammar, not a
schema), and nothing the scheduler adds later (state, KV, timings).

A request with ``params.n`` > 1 stands for its n samples: ``samples`` splits it into n one-sample requests
(the only kind ``to_req`` takes), and ``warmup`` is the prompt-only request that computes its KV once first.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.grammar.state import GrammarState
from engine.model.vlm.mm import MMItem
from engine.scheduler.logprobs import LogprobRequest, LogprobState
from engine.scheduler.req import Bootstrap, Req, ReqOutput
from engine.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    import xgrammar as xgr


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt and everything asked for it; frozen (build a changed copy with ``dataclasses.replace``).

    - ``input_ids``: the prompt, token ids (images' pad ids included for a vision-language model); checked by
      ``Engine.check_request`` before it is submitted. Not copied here; ``to_req`` gives the scheduler a copy.
    - ``params``: sampling and stop parameters (``SamplingParams``, checked); ``params.n`` samples.
    - ``rid``: the client's request id (upstream's ``rid``), or None for a generated one; only for n 1.
    - ``bootstrap``: the PD pairing the router put in the body (``Engine.bootstrap``): None off PD, one
      ``Bootstrap``, or for n > 1 a list of n (sample j pairs with room j).
    - ``cache_salt``: the cache key space (``engine/server/tenants.request_salt``: the tenant's, and the
      body's ``cache_salt`` / ``extra_key``); None is the shared space. Never logged (``repr`` omits it).
    - ``mm_items``: the prompt's images (token ranges and embeddings, ``ImageInputs.prepare``); empty for
      a text prompt.
    - ``logprob``: the log-probabilities to report (``LogprobRequest``), or None.
    - ``grammar``: the compiled grammar of ``params.constraint`` (``Engine.compile_grammar``), or None when
      the output is unconstrained; each sample gets its own matcher of it (``to_req``).
    - ``health_check``: a ``/health_generate`` probe, queued ahead of user requests.
    """

    input_ids: list[int]
    params: SamplingParams
    rid: str | None = None
    bootstrap: Bootstrap | list[Bootstrap] | None = None
    cache_salt: str | None = field(default=None, repr=False)
    mm_items: Sequence[MMItem] = field(default=(), repr=False)
    logprob: LogprobRequest | None = None
    grammar: xgr.CompiledGrammar | None = field(default=None, repr=False)
    health_check: bool = False

    @property
    def pairings(self) -> list[Bootstrap]:
        """The PD pairings: none, one, or one per sample."""
        if self.bootstrap is None:
            return []
        return list(self.bootstrap) if isinstance(self.bootstrap, list) else [self.bootstrap]

    def samples(self) -> list[GenerateRequest]:
        """The one-sample requests of this one, in sample order: itself when ``params.n`` is 1 (with the first
        pairing when ``bootstrap`` is a list); else n copies with n 1, seed ``sampling_seed + j`` for sample
        ``j`` when seeded (so the samples differ, reproducibly), pairing j of a list ``bootstrap`` (one
        ``Bootstrap`` is shared) and no ``rid`` (the routes refuse a rid with n > 1)."""
        n = self.params.n
        per = self.bootstrap if isinstance(self.bootstrap, list) else [self.bootstrap] * n
        if n == 1:
            return [dataclasses.replace(self, bootstrap=per[0]) if isinstance(self.bootstrap, list) else self]
        return [
            dataclasses.replace(self, params=sample_params(self.params, j), rid=None, bootstrap=per[j])
            for j in range(n)
        ]

    def warmup(self) -> GenerateRequest:
        """The prompt-only request computed before n > 1 samples start, so they find the prompt in the prefix
        cache: the same prompt, images and salt with n 1, ``max_new_tokens`` and ``min_new_tokens`` 0, and
        nothing else asked (no rid, pairing, log-probabilities or grammar)."""
        params = dataclasses.replace(self.params, n=1, max_new_tokens=0, min_new_tokens=0)
        return GenerateRequest(self.input_ids, params, cache_salt=self.cache_salt, mm_items=self.mm_items)

    def to_req(self, on_event: Callable[[ReqOutput], object]) -> Req:
        """The scheduler's ``Req`` of this one-sample request: ``rid`` or a fresh uuid4 hex, a copy of the
        prompt and images, a ``LogprobState`` of ``logprob``, a ``GrammarState`` (its own matcher) of
        ``grammar``, a torch generator seeded with ``params.sampling_seed`` when set. ``on_event`` is called
        on the scheduler thread with each ``ReqOutput`` and must only hand it over; the ``Req`` keeps this
        request as its ``request``. ``ValueError`` when
        ``bootstrap`` is a list (a request of several samples: submit its ``samples()``)."""
        if isinstance(self.bootstrap, list):
            raise ValueError("bootstrap: one pairing per sample; submit each of samples() instead")
        req = Req(
            self.rid or uuid.uuid4().hex,
            list(self.input_ids),
            self.params,
            on_event,
            health_check=self.health_check,
            bootstrap=self.bootstrap,
            cache_salt=self.cache_salt,
            mm_items=list(self.mm_items),
            logprob=None if self.logprob is None else LogprobState(self.logprob),
            grammar=None if self.grammar is None else GrammarState(self.grammar),
            request=self,
        )
        if self.params.sampling_seed is not None:
            req.generator = torch.Generator().manual_seed(self.params.sampling_seed)
        return req


def sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """The parameters of sample ``j`` (0-based) of an ``n`` > 1 request: n 1, and seed + j when seeded."""
    seed = params.sampling_seed
    return dataclasses.replace(params, n=1, sampling_seed=None if seed is None else seed + j)
