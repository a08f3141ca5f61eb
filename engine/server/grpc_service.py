"""``--grpc-mode``: the worker serves smg's gRPC ``SglangScheduler`` (``smg-grpc-proto``) instead of HTTP.

smg (the router) tokenizes and detokenizes itself and sends a gRPC worker token ids; in return it can
subscribe to the worker's KV cache events (``SubscribeKvEvents``) and route by the pages each worker
really holds (its precise, event-driven index) instead of its approximate tree of what it sent where.

RPCs served (the ones smg calls on a regular worker):

* ``Generate``: ``tokenized.input_ids`` and ``sampling_params`` (mapped field by field onto
  ``SamplingParams.from_dict``, proto3's unset zeros read as the neutral values, as upstream) run through
  ``Engine.stream``, the path ``POST /generate`` uses; with ``stream`` one ``GenerateStreamChunk`` per
  scheduler event (its new ids) then a ``GenerateComplete``, else the ``GenerateComplete`` only; ``n`` > 1
  runs one request per sample (``index``). A bad request is ``INVALID_ARGUMENT`` with the
  engine's message (naming the field); an engine abort ``UNAVAILABLE`` / ``RESOURCE_EXHAUSTED`` /
  ``INTERNAL`` by its status code; a ``cache_salt`` in ``sampling_params.custom_params`` is the salt.
* ``HealthCheck`` (the checks of ``GET /health``), ``Abort`` (by ``request_id``), ``GetModelInfo``,
  ``GetServerInfo`` (``/server_info``'s body as a Struct), ``GetLoads`` (``/v1/loads``' figures),
  ``FlushCache`` (the idle-gated flush of ``/flush_cache``), ``GetTokenizer`` (a zip of the model folder's
  tokenizer files, in 1 MiB chunks, the last carrying the archive's SHA-256).
* ``SubscribeKvEvents`` (``UNIMPLEMENTED`` with ``--disable-kv-events``): the cache's
  :class:`engine.cache.kv_events.KVEventLog` as ``KvEventBatch``es, polled every ``EVENT_POLL_S``:
  ``stored`` (blocks with their token ids, ``parent_block_hash``, the tier as ``tier`` and ``cache_level``
  0 device / 1 host, ``cache_salt``), ``removed``, ``cleared``. Block
  hashes are the prefix-chained page ids (signed 64 bit). ``start_sequence_number`` N > 0 resumes with
  the kept batches after N; 0 starts with a snapshot of the pages the tree holds (one ``KvSnapshotChunk``
  batch numbered with the last sealed sequence: ``cleared``, then a ``stored`` per node and tier, parents
  first, event ids 0), then the batches after it.
  Each batch carries the worker's load (``EngineLoad``).

Not served (``UNIMPLEMENTED``): ``Embed``, profiling, LoRA adapters. Everything runs on the gRPC server's
event loop; the scheduler thread is reached only through ``Engine`` and the cache's event log.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import time
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from google.protobuf import struct_pb2
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

from engine.cache.kv_events import TIERS, Cleared, KVEventLog, Removed, Stored
from engine.scheduler import NotIdleError, SamplingParams
from engine.scheduler.messages import FlushCache, SnapshotKVEvents
from engine.scheduler.request import GenerateRequest
from engine.server.engine import Engine, RequestError, UnavailableError
from engine.server.http_utils import interleave
from engine.server.info import VERSION, _health_problem, server_info
from engine.server.loads import rank_load

logger = logging.getLogger(__name__)

EVENT_POLL_S = 0.02
"""How often a KV-event stream seals and sends what the cache published (seconds)."""
HEARTBEAT_S = 1.0
"""A stream with nothing to send sends a ``load_only`` batch this often (seconds)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
CHUNK_BYTES = 1 << 20
_TIER_ENUM = {"device": common_pb2.KV_CACHE_TIER_DEVICE, "host": common_pb2.KV_CACHE_TIER_HOST}
_U64 = 1 << 64
_ABORT_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def to_int64(value: int) -> int:
    """A page id (unsigned 64 bit) as the proto's signed ``int64`` block hash."""
    value %= _U64
    return value - _U64 if value >= 1 << 63 else value


def sampling_dict(p: sglang_scheduler_pb2.SamplingParams) -> dict:
    """The ``sampling_params`` dict ``SamplingParams.from_dict`` takes, from the proto's fields (an unset
    ``top_p``, ``top_k``, ``repetition_penalty`` or ``n`` is 0 on the wire and means the neutral value)."""
    out: dict = {
        "temperature": p.temperature,
        "top_p": p.top_p or 1.0,
        "top_k": p.top_k or -1,
        "min_p": p.min_p,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
        "repetition_penalty": p.repetition_penalty or 1.0,
        "min_new_tokens": p.min_new_tokens,
        "ignore_eos": p.ignore_eos,
        "skip_special_tokens": p.skip_special_tokens,
        "no_stop_trim": p.no_stop_trim,
        "n": p.n or 1,
    }
    if p.HasField("max_new_tokens"):
        out["max_new_tokens"] = p.max_new_tokens
    if p.stop:
        out["stop"] = list(p.stop)
    if p.stop_token_ids:
        out["stop_token_ids"] = list(p.stop_token_ids)
    if p.logit_bias:
        out["logit_bias"] = dict(p.logit_bias)
    constraint = p.WhichOneof("constraint")
    if constraint is not None:
        out["ebnf" if constraint == "ebnf_grammar" else constraint] = getattr(p, constraint)
    return out


def _salt(p: sglang_scheduler_pb2.SamplingParams) -> str | None:
    if not p.HasField("custom_params"):
        return None
    salt = p.custom_params.fields.get("cache_salt")
    return salt.string_value if salt is not None and salt.WhichOneof("kind") == "string_value" else None


def event_proto(event, event_id: int) -> common_pb2.KvCacheEvent:
    """One cache event (``engine.cache.kv_events``) as smg's ``KvCacheEvent``."""
    if isinstance(event, Stored):
        level = TIERS.index(event.tier)
        size = event.page_size
        blocks = [
            common_pb2.KvBlock(
                block_hash=to_int64(page),
                token_ids=event.token_ids[i * size : (i + 1) * size],
                block_size=size,
                cache_level=level,
            )
            for i, page in enumerate(event.page_ids)
        ]
        stored = common_pb2.KvBlocksStored(
            blocks=blocks,
            tier=_TIER_ENUM[event.tier],
            medium="GPU" if event.tier == "device" else "CPU_PINNED",
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
        )
        if event.parent_id is not None:
            stored.parent_block_hash = to_int64(event.parent_id)
        if event.salt is not None:
            stored.cache_salt = event.salt
        return common_pb2.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, Removed):
        removed = common_pb2.KvBlocksRemoved(
            block_hashes=[to_int64(p) for p in event.page_ids],
            cache_level=TIERS.index(event.tier),
            tier=_TIER_ENUM[event.tier],
            locality=common_pb2.KV_CACHE_LOCALITY_LOCAL,
        )
        return common_pb2.KvCacheEvent(event_id=event_id, removed=removed)
    assert isinstance(event, Cleared), f"unknown cache event {event!r}"
    return common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared())


def _struct(data: dict) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(json.loads(json.dumps(data, default=str)))
    return out


def tokenizer_zip(folder: Path) -> tuple[bytes, str]:
    """The tokenizer files of ``folder`` (those of ``TOKENIZER_FILES`` it has) as a zip, and its SHA-256."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                zf.write(folder / name, name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


class SchedulerServicer(sglang_scheduler_pb2_grpc.SglangSchedulerServicer):
    """smg's ``SglangScheduler`` over one started :class:`Engine` and its cache's event log ``events``."""

    def __init__(self, engine: Engine, events: KVEventLog | None) -> None:
        self.engine = engine
        self.events = events
        self.running: dict[str, set[str]] = {}  # request_id -> the engine rids it runs (n samples)

    # -- generation -----------------------------------------------------------------------------------------
    async def Generate(self, request, context) -> AsyncIterator[sglang_scheduler_pb2.GenerateResponse]:
        engine = self.engine
        rid = request.request_id or None
        prompt = list(request.tokenized.input_ids)
        try:
            if request.return_hidden_states or request.input_embeds:
                raise RequestError("return_hidden_states / input_embeds are not supported")
            if request.HasField("disaggregated_params"):
                raise RequestError("disaggregated_params: this worker is not a PD worker")
            if not prompt:
                raise RequestError("tokenized.input_ids: the prompt is empty")
            params = SamplingParams.from_dict(sampling_dict(request.sampling_params))
            grammar = await engine.compile_grammar(params)
        except (RequestError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        n = params.n
        rids = [f"{rid}-{j}" if rid and n > 1 else rid for j in range(n)]
        one = GenerateRequest(
            prompt, params, rid=rid, cache_salt=_salt(request.sampling_params), grammar=grammar
        )
        samples = [dataclasses.replace(s, rid=rids[j]) for j, s in enumerate(one.samples())]
        streams = [engine.stream(s) for s in samples]
        key = rid or ""
        self.running[key] = {r for r in rids if r}
        ids: dict[int, list[int]] = {j: [] for j in range(n)}
        try:
            async for j, ev in interleave(streams):
                reason = ev.finish_reason or {}
                if reason.get("type") == "abort":
                    code = _ABORT_CODES.get(reason.get("status_code", 500), grpc.StatusCode.INTERNAL)
                    await context.abort(code, reason.get("message", "aborted"))
                ids[j].extend(ev.new_ids)
                counts = {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(ids[j]),
                    "cached_tokens": ev.meta.get("cached_tokens", 0) if ev.meta else 0,
                }
                if request.stream and ev.new_ids:
                    chunk = sglang_scheduler_pb2.GenerateStreamChunk(token_ids=ev.new_ids, index=j, **counts)
                    yield sglang_scheduler_pb2.GenerateResponse(request_id=request.request_id, chunk=chunk)
                if ev.finished:
                    yield sglang_scheduler_pb2.GenerateResponse(
                        request_id=request.request_id, complete=self._complete(ids[j], reason, counts, j)
                    )
        except (RequestError, ValueError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except UnavailableError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            self.running.pop(key, None)

    @staticmethod
    def _complete(ids: list[int], reason: dict, counts: dict, index: int):
        kind = reason.get("type", "stop")
        complete = sglang_scheduler_pb2.GenerateComplete(
            output_ids=ids, finish_reason=kind, index=index, **counts
        )
        matched = reason.get("matched")
        if isinstance(matched, int):
            complete.matched_token_id = matched
        elif isinstance(matched, str):
            complete.matched_stop_str = matched
        return complete

    async def Abort(self, request, context):
        rids = self.running.get(request.request_id) or {request.request_id}
        for rid in rids:
            self.engine.scheduler.abort(rid)
        return sglang_scheduler_pb2.AbortResponse(success=True, message=f"aborted {len(rids)} request(s)")

    # -- health, info, loads --------------------------------------------------------------------------------
    async def HealthCheck(self, request, context):
        problem = _health_problem(self.engine)
        return sglang_scheduler_pb2.HealthCheckResponse(healthy=problem is None, message=problem or "ok")

    async def GetModelInfo(self, request, context):
        engine = self.engine
        eos = engine.model_info.get("eos_token_ids") or sorted(engine.tokenizer.eos_token_ids)
        return sglang_scheduler_pb2.GetModelInfoResponse(
            model_path=engine.args.model_path,
            tokenizer_path=engine.args.model_path,
            is_generation=True,
            weight_version="default",
            served_model_name=engine.model_name,
            max_context_length=engine.context_length,
            vocab_size=engine.vocab_size,
            supports_vision=engine.images is not None,
            model_type=str(engine.model_info.get("model_type", "")),
            eos_token_ids=list(eos),
            max_req_input_len=engine.context_length,
        )

    async def GetServerInfo(self, request, context):
        info = server_info(self.engine)
        return sglang_scheduler_pb2.GetServerInfoResponse(
            server_args=_struct(info),
            active_requests=info["num_running_reqs"] + info["num_waiting_reqs"],
            uptime_seconds=time.time() - self.engine.started_at,
            sglang_version=VERSION,
            server_type="grpc",
            max_total_num_tokens=info.get("max_total_num_tokens") or 0,
        )

    async def GetLoads(self, request, context):
        rank = rank_load(self.engine, {"memory", "queues"})
        load = sglang_scheduler_pb2.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=rank["num_running_reqs"],
            num_waiting_reqs=rank["num_waiting_reqs"],
            num_total_reqs=rank["num_running_reqs"] + rank["num_waiting_reqs"],
            num_used_tokens=rank["num_used_tokens"],
            max_total_num_tokens=rank["max_total_num_tokens"],
            token_usage=rank["token_usage"],
            max_running_requests=rank["max_running_requests"],
            memory=sglang_scheduler_pb2.MemoryMetrics(
                token_capacity=rank["memory"]["token_capacity"],
                kv_cache_gb=rank["memory"].get("kv_cache_gb", 0.0),
            ),
            queues=sglang_scheduler_pb2.QueueMetrics(waiting=rank["queues"]["waiting"]),
        )
        return sglang_scheduler_pb2.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version=VERSION,
            dp_rank_count=1,
            loads=[load],
        )

    def _engine_load(self, load_only: bool, sample: int) -> common_pb2.EngineLoad:
        """The load record a KV-event batch carries (the routing core; the token counts on heartbeats)."""
        rank = rank_load(self.engine, set())
        load = common_pb2.EngineLoad(
            running_requests=rank["num_running_reqs"],
            waiting_requests=rank["num_waiting_reqs"],
            token_usage=rank["token_usage"],
            max_running_requests=rank["max_running_requests"],
            sample=sample,
            load_only=load_only,
        )
        if load_only:
            load.num_used_tokens = rank["num_used_tokens"]
            load.max_total_num_tokens = rank["max_total_num_tokens"]
        return load

    # -- cache ----------------------------------------------------------------------------------------------
    async def FlushCache(self, request, context):
        try:
            await self.engine.post(FlushCache(), timeout=request.timeout_s or None)
        except NotIdleError as exc:
            return common_pb2.FlushCacheResponse(success=False, message=f"Cache not flushed: {exc}")
        return common_pb2.FlushCacheResponse(success=True, message="Cache flushed.")

    async def GetTokenizer(self, request, context):
        data, sha = await asyncio.to_thread(tokenizer_zip, Path(self.engine.args.model_path))
        for start in range(0, max(len(data), 1), CHUNK_BYTES):
            last = start + CHUNK_BYTES >= len(data)
            chunk = data[start : start + CHUNK_BYTES]
            yield common_pb2.GetTokenizerChunk(data=chunk, sha256=sha if last else "")

    async def SubscribeKvEvents(self, request, context) -> AsyncIterator[common_pb2.KvEventBatch]:
        log = self.events
        if log is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV events are off (--disable-kv-events)")
            return
        sample, quiet_since = 0, time.monotonic()
        if request.load_records_before_first_batch:
            sample += 1
            yield common_pb2.KvEventBatch(sequence_number=0, load=self._engine_load(True, sample))
        cursor = request.start_sequence_number
        if not cursor:  # from the current state: a snapshot of the tree's pages, then what follows it
            cursor, held = await self.engine.post(SnapshotKVEvents())
            if held and cursor:
                sample += 1
                events = [event_proto(e, 0) for e in (Cleared(), *held)]
                yield common_pb2.KvEventBatch(
                    sequence_number=cursor,
                    timestamp=time.time(),
                    events=events,
                    dp_rank=0,
                    snapshot=common_pb2.KvSnapshotChunk(
                        index=0, count=1, blocks=sum(len(e.page_ids) for e in held)
                    ),
                    load=self._engine_load(False, sample),
                )
        while not context.done():
            log.seal()
            batches = log.since(cursor)
            for batch in batches:
                sample += 1
                events = [event_proto(e, batch.first_id + i) for i, e in enumerate(batch.events)]
                yield common_pb2.KvEventBatch(
                    sequence_number=batch.sequence,
                    timestamp=batch.timestamp,
                    events=events,
                    dp_rank=0,
                    load=self._engine_load(False, sample),
                )
                cursor = batch.sequence
            now = time.monotonic()
            if batches:
                quiet_since = now
            elif now - quiet_since >= HEARTBEAT_S and cursor:
                sample += 1
                quiet_since = now
                yield common_pb2.KvEventBatch(
                    sequence_number=cursor, dp_rank=0, load=self._engine_load(True, sample)
                )
            await asyncio.sleep(EVENT_POLL_S)


def attach_events(engine: Engine) -> KVEventLog:
    """A :class:`KVEventLog` the engine's radix tree now reports to (call before serving)."""
    log = KVEventLog()
    engine.scheduler.cache.tree.events = log
    return log


async def serve(engine: Engine, events: KVEventLog | None, host: str, port: int, stop: asyncio.Event) -> None:
    """Serve the servicer on ``host:port`` until ``stop`` is set (or the scheduler thread dies); raises
    ``RuntimeError`` when the port cannot be bound."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(SchedulerServicer(engine, events), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if server.add_insecure_port(address) == 0:
        raise RuntimeError(f"--port {port}: cannot listen on {address}")
    await server.start()
    logger.info("serving smg's gRPC SglangScheduler on %s", address)
    while not stop.is_set() and engine.scheduler.is_alive():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.5)
    await server.stop(grace=2)
