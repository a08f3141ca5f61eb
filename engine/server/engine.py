"""The HTTP side's handle on a running engine: submit requests to the scheduler thread and await events.

Nothing here touches the model or the cache. Requests go to ``Scheduler.submit``; the scheduler hands each
event to ``loop.call_soon_threadsafe`` so it lands in the request's ``asyncio.Queue``. Admin work runs on the
scheduler thread through ``Scheduler.call`` and is awaited as a future.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.grammar.backend import GrammarBackend, GrammarError
from engine.model.vlm.mm import MMItem
from engine.scheduler import ReqOutput, SamplingParams, Scheduler
from engine.scheduler.logprobs import LogprobValues
from engine.scheduler.messages import AdminMsg
from engine.scheduler.req import Bootstrap
from engine.scheduler.request import GenerateRequest
from engine.scheduler.sampling_params import label
from engine.server.args import ServerArgs
from engine.server.dp import DPAdmin, DPDispatcher
from engine.server.images import ImageInputs
from engine.server.recording import TraceRecorder
from engine.server.tenants import Tenants

if TYPE_CHECKING:
    import xgrammar as xgr

    from engine.model.tokenizer import Tokenizer
    from engine.server.metrics import EngineMetrics
    from engine.server.tp_ranks import RankProcesses


class RequestError(ValueError):
    """Bad request input (HTTP 400); the message says what is wrong."""


class UnavailableError(RuntimeError):
    """The worker cannot take the request now (HTTP 503): its scheduler thread is not running, it is marked
    unhealthy, or its waiting queue is full (``--max-queued-requests``); the message says which."""


@dataclass
class Engine:
    """Launch args, tokenizer, scheduler and metrics of one worker."""

    args: ServerArgs
    tokenizer: Tokenizer
    scheduler: Scheduler
    context_length: int
    vocab_size: int
    metrics: EngineMetrics | None = None
    model_info: dict = field(default_factory=dict)
    recorder: TraceRecorder | None = None  # --record-trace
    tenants: Tenants | None = None  # --tenant-keys-file
    images: ImageInputs | None = None  # a vision-language model: image sources to tokens and embeddings
    grammar: GrammarBackend | None = None  # --grammar-backend xgrammar (None: none)
    unhealthy: str | None = None  # set by a failed PD role switch: /health answers 503 with it
    started_at: float = field(default_factory=time.time)
    tp_ranks: RankProcesses | None = None  # tensor parallelism: ranks 1..tp-1
    dp: DPDispatcher | None = None  # DP attention: the DP ranks (rank 0 is ``scheduler``) and the dispatch
    admin: DPAdmin = field(init=False)

    def __post_init__(self) -> None:
        if self.dp is None:
            self.dp = DPDispatcher([self.scheduler])
        self.admin = DPAdmin(self.dp)

    @property
    def schedulers(self) -> list[Scheduler]:
        """Every DP rank's scheduler, rank 0 first (one without ``--enable-dp-attention``)."""
        assert self.dp is not None, "set in __post_init__"
        return self.dp.schedulers

    def mark_unhealthy(self, reason: str) -> None:
        """From now on ``/health`` answers 503 with ``reason`` and new requests are refused with it."""
        self.unhealthy = reason

    def shutdown(self) -> None:
        """Stop the scheduler (rank 0 tells the other ranks to stop) and wait for the other ranks."""
        if self.tp_ranks is not None:
            self.tp_ranks.stopping = True
        for sched in reversed(self.schedulers):
            sched.stop()
        if self.tp_ranks is not None:
            self.tp_ranks.stop()

    @property
    def model_name(self) -> str:
        return self.args.model_name

    # ------------------------------------------------------------------ tokens and text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_prompt(
        self,
        messages: list[dict],
        continue_final_message: bool = False,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template.

        ``add_generation_prompt`` opens the assistant turn (default, upstream). With
        ``continue_final_message`` the last (assistant) message is left open instead, as transformers does:
        the rendering is cut right after its content. Raises ``ValueError`` (``ChatTemplateError``) on
        failure.
        """
        text = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            **template_kwargs,
        )
        if continue_final_message:
            content = str(messages[-1].get("content") or "")
            end = text.rfind(content)
            if end < 0:
                raise ValueError("continue_final_message: the final message is not in the rendered prompt")
            text = text[: end + len(content)]
        return self.encode(text, add_special_tokens=False)

    def output_text(self, ids: list[int], params: SamplingParams, finish_reason: dict | None) -> str:
        """Decoded output; a matched stop string and what follows it are cut unless ``no_stop_trim``."""
        text = self.decode(ids, params.skip_special_tokens)
        matched = (finish_reason or {}).get("matched")
        if isinstance(matched, str) and not params.no_stop_trim:
            pos = text.find(matched)
            if pos >= 0:
                text = text[:pos]
        return text

    # ------------------------------------------------------------------ requests
    def check_request(
        self,
        input_ids: list[int],
        params: SamplingParams,
        names: dict[str, str] | None = None,
        source: str = "the input messages",
        bootstrap: Bootstrap | list[Bootstrap] | None = None,
        mm_items: Sequence[MMItem] = (),
    ) -> None:
        """``_check_request`` (ids may also be the pad ids of ``mm_items``' images); a PD request
        (``bootstrap``) a decode worker refuses also has its room
        aborted at the prefill (``refuse_room``), so P fails its copy at once instead of holding it."""
        try:
            self._check_request(input_ids, params, names, source, {i.pad_value for i in mm_items})
        except RequestError as exc:
            if bootstrap is not None:
                self.refuse_room(bootstrap, str(exc))
            raise

    def refuse_room(self, bootstrap: Bootstrap | list[Bootstrap], reason: str) -> None:
        """On a decode worker: tell the prefill named by ``bootstrap`` (each of a list) that this request is
        refused (its copy there fails with 400 naming ``reason``). Nothing on a prefill or aggregated
        worker."""
        pd = self.scheduler.pd
        if pd is not None and not pd.sends_kv:
            for b in _each(bootstrap):
                pd.mgr.refuse(b.host, b.port, b.room, reason)

    def fail_room(self, bootstrap: Bootstrap | list[Bootstrap], reason: str) -> None:
        """On a prefill worker: fail the room (each of a list) of a PD request refused before it was queued
        (its images could not be prepared), so its decode ends it now instead of waiting for KV. Nothing
        elsewhere."""
        pd = self.scheduler.pd
        if pd is not None and pd.sends_kv:
            for b in _each(bootstrap):
                pd.mgr.fail_unopened(b.room, reason)

    def _check_request(
        self,
        input_ids: list[int],
        params: SamplingParams,
        names: dict[str, str] | None = None,
        source: str = "the input messages",
        pads: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        """Check ids (each in the vocabulary or one of ``pads``, its images' pad ids), seed range (torch's)
        and length vs context and KV pool (RequestError); UnavailableError
        without scheduler. ``names`` maps SamplingParams fields to the client's (as in
        ``SamplingParams.from_dict``); ``source`` is what the context-length error calls the prompt (upstream:
        ``... 9 tokens from the input messages and 5000 tokens for the completion ...``)."""
        for sched in self.schedulers:
            if not sched.is_alive():
                raise UnavailableError(f"scheduler thread is not running: {sched.error!r}")
        if self.unhealthy:
            raise UnavailableError(self.unhealthy)
        if not input_ids:
            raise RequestError("the prompt is empty")
        if any(
            not isinstance(t, int) or isinstance(t, bool) or not (0 <= t < self.vocab_size or t in pads)
            for t in input_ids
        ):
            raise RequestError(f"input_ids must be integers in [0, {self.vocab_size})")
        bias = params.logit_bias or {}
        if any(t >= self.vocab_size for t in bias):
            raise RequestError(
                f"{label('logit_bias', names)} keys must be token ids in [0, {self.vocab_size})"
            )
        seed = params.sampling_seed
        if seed is not None and not -(2**63) <= seed < 2**64:
            raise RequestError(f"{label('sampling_seed', names)} must be in [-2**63, 2**64)")
        n, max_new = len(input_ids), params.max_new_tokens
        if n >= self.context_length:
            raise RequestError(
                f"The input ({n} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        if n + max_new > self.context_length:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} "
                f"tokens. You requested a total of {_tokens(n + max_new)}: {_tokens(n)} from {source} and "
                f"{_tokens(max_new)} for the completion."
            )
        capacity = self.scheduler.pool.size
        if n + max_new > capacity:
            raise RequestError(
                f"prompt ({n}) + {label('max_new_tokens', names)} ({max_new}) exceeds the KV pool "
                f"({capacity} tokens)"
            )

    def bootstrap(self, body: dict, n: int = 1) -> Bootstrap | list[Bootstrap] | None:
        """The PD pairing the router put into ``body`` (``bootstrap_host``, ``bootstrap_port``,
        ``bootstrap_room``), checked; None for a request without one on a worker not in PD mode. For
        ``n`` > 1 samples, a list of n pairings: the router sends a list of n rooms (and hosts and ports,
        which may also be one value for all), one per sample; a single room stands for rooms room + j
        (sample j), as upstream fans it out.

        RequestError: ``bootstrap_room`` on a worker not in PD mode (``--disaggregation-mode null``: running
        it here would do the whole request on each of the pair, twice the work, silently); on a PD worker a
        missing or bad field (named), lists with n 1 (one prompt per PD request here), or lists whose length
        is not n.
        """
        host, port, room = (body.get(f"bootstrap_{k}") for k in ("host", "port", "room"))
        if self.args.disaggregation_mode == "null":
            if room is not None:
                raise RequestError(
                    "bootstrap_room: this worker is not a PD worker (--disaggregation-mode null); "
                    "send PD requests to workers started with --disaggregation-mode prefill or decode"
                )
            return None
        mode = self.args.disaggregation_mode
        if host is None and port is None and room is None:
            raise RequestError(
                f"bootstrap_room: this is a PD {mode} worker; requests come through a PD router, which adds "
                "bootstrap_host, bootstrap_port and bootstrap_room"
            )
        lists = [isinstance(v, list) for v in (host, port, room)]
        if n == 1:
            if any(lists):
                raise RequestError(
                    "bootstrap_room: one prompt per PD request (batched rooms are not supported)"
                )
            return _pairing(host, port, room)
        if isinstance(room, int) and not isinstance(room, bool) and 0 <= room < 2**63:
            room = [(room + j) % 2**63 for j in range(n)]  # one room for all: sample j takes room + j
        if not isinstance(room, list) or len(room) != n:
            raise RequestError(
                f"bootstrap_room: n={n} samples need one room or a list of {n}, one per sample"
            )
        for name, value in (("bootstrap_host", host), ("bootstrap_port", port)):
            if isinstance(value, list) and len(value) != n:
                raise RequestError(f"{name}: n={n} samples need one value or a list of {n}")
        hosts = host if isinstance(host, list) else [host] * n
        ports = port if isinstance(port, list) else [port] * n
        if len(set(map(str, room))) != n:
            raise RequestError("bootstrap_room: the samples' rooms must differ")
        return [_pairing(h, p, r) for h, p, r in zip(hosts, ports, room, strict=True)]

    async def compile_grammar(
        self, params: SamplingParams, names: dict[str, str] | None = None
    ) -> xgr.CompiledGrammar | None:
        """The compiled grammar of ``params``' constraint (``json_schema``, ``regex``, ``ebnf``,
        ``structural_tag``), or None when it has none; compiled on the grammar backend's threads (cached), so
        the event loop and the scheduler go on meanwhile. RequestError names the field (``names`` as in
        ``SamplingParams.from_dict``) when it does not compile, or ``--grammar-backend`` when it is none."""
        constraint = params.constraint
        if constraint is None:
            return None
        field, text = constraint
        if self.grammar is None:
            raise RequestError(
                f"{label(field, names)}: constrained decoding is off on this worker (--grammar-backend none)"
            )
        try:
            return await asyncio.wrap_future(self.grammar.compile(field, text))
        except GrammarError as exc:
            problem = str(exc).partition(": ")[2]
            raise RequestError(f"{label(field, names)}: {problem}") from None

    def default_max_new_tokens(self, input_ids: list[int]) -> int:
        """OpenAI requests without ``max_tokens`` may use the rest of the context (upstream behaviour)."""
        return max(0, min(self.context_length, self.scheduler.pool.size) - len(input_ids))

    async def stream(self, request: GenerateRequest) -> AsyncIterator[ReqOutput]:
        """Submit one-sample ``request`` (checked again here: ``check_request``, which also raises
        ``UnavailableError``) as the scheduler's ``Req`` (``GenerateRequest.to_req``) and yield its events up
        to the finished one; abort it if the caller stops early. A finished request is recorded with
        ``--record-trace``. ``ValueError`` when ``request`` has one pairing per sample (stream each of its
        ``samples()``)."""
        self.check_request(request.input_ids, request.params, mm_items=request.mm_items)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[ReqOutput] = asyncio.Queue()
        put: Callable[[ReqOutput], None] = events.put_nowait
        req = request.to_req(lambda ev: loop.call_soon_threadsafe(put, ev))
        arrival = time.time()
        assert self.dp is not None, "set in __post_init__"
        rank = await self.dp.pick(req.input_ids, request.cache_salt)
        sched = self.dp.schedulers[rank]
        try:
            sched.submit(req)
        except BaseException:
            self.dp.done(rank)
            raise
        finished = False
        output_ids: list[int] = []
        try:
            while True:
                ev = await events.get()
                finished = ev.finished
                output_ids += ev.new_ids
                if finished and self.recorder is not None:
                    self.recorder.record(req.input_ids, output_ids, arrival, req.misses)
                yield ev
                if finished:
                    return
        finally:
            self.dp.done(rank)
            if not finished:
                sched.abort(req.rid)

    async def generate(self, request: GenerateRequest) -> dict:
        """Run one-sample ``request`` to the end; returns ``{"output_ids", "finish_reason", "meta",
        "logprobs"}`` (``logprobs``: ``{"input": LogprobValues, "output": LogprobValues}`` when
        ``request.logprob`` asked, else None). Raises what ``stream`` raises, and ``UnavailableError`` when
        the scheduler refused it (queue full) or ended before finishing it."""
        ids: list[int] = []
        meta: dict = {}
        reason = None
        values = None if request.logprob is None else {"input": LogprobValues(), "output": LogprobValues()}
        async for ev in self.stream(request):
            ids.extend(ev.new_ids)
            meta.update(ev.meta)
            reason = ev.finish_reason
            if values is not None and ev.logprobs is not None:
                values["input"].extend(ev.logprobs["input"])
                values["output"].extend(ev.logprobs["output"])
        if reason and reason.get("status_code") == 503:  # queue full, or the scheduler ended
            raise UnavailableError(reason.get("message", "scheduler thread is not running"))
        return {"output_ids": ids, "finish_reason": reason, "meta": meta, "logprobs": values}

    async def generate_n(self, request: GenerateRequest) -> list[dict]:
        """The ``request.params.n`` samples of one prompt (``generate``'s results, in sample order; a list of
        one, the aborted result, when the prompt-only first pass was aborted). For n > 1 the prompt is
        computed once first (``prefill_once``), so the samples share its KV through the prefix cache; then
        ``request.samples()`` run concurrently (sample ``j`` seeded ``sampling_seed + j`` when seeded, paired
        with room j of a PD request, each with its own matcher of the grammar). A PD request skips the first
        pass (a PD worker serves only paired requests). A rid needs n 1 (the routes refuse it)."""
        samples = request.samples()
        if len(samples) == 1:
            return [await self.generate(samples[0])]
        warm = await self.prefill_once(request)
        if warm is not None:
            return [warm]
        return list(await asyncio.gather(*(self.generate(s) for s in samples)))

    async def prefill_once(self, request: GenerateRequest) -> dict | None:
        """Compute ``request``'s prompt KV once (its ``warmup()``: a ``max_new_tokens`` 0 request) so that the
        ``n`` samples started after it find the prompt in the prefix cache. Returns None when done or when
        ``request`` is a PD one (nothing is run: each sample's prompt is computed on its prefill worker), else
        the aborted result (its ``finish_reason`` says why). Raises what ``generate`` raises."""
        if request.bootstrap is not None:
            return None
        first = await self.generate(request.warmup())
        return first if (first["finish_reason"] or {}).get("type") == "abort" else None

    async def post(self, msg: AdminMsg, timeout: float | None = None):
        """Carry out the admin message ``msg`` (``engine.scheduler.messages``) on the scheduler thread and
        await its result; raises what the scheduler raised for it."""
        return await asyncio.wait_for(asyncio.wrap_future(self.scheduler.post(msg)), timeout)


def _pairing(host, port, room) -> Bootstrap:
    """One checked PD pairing; RequestError naming the bad field."""
    if not isinstance(host, str) or not host:
        raise RequestError("bootstrap_host must be the prefill server's host name or address")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise RequestError(f"bootstrap_port must be an integer in 1..65535, got {port!r}")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < 2**63:
        raise RequestError(f"bootstrap_room must be an integer in [0, 2**63), got {room!r}")
    return Bootstrap(host, port, room)


def _each(bootstrap: Bootstrap | list[Bootstrap] | None) -> list[Bootstrap]:
    """The pairings of one request: none, one, or one per sample."""
    if bootstrap is None:
        return []
    return bootstrap if isinstance(bootstrap, list) else [bootstrap]


def _tokens(count: int) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{count} token" if count == 1 else f"{count} tokens"
