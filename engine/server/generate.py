"""SGLang's native ``POST /generate``.

Body (``schemas.GenerateReqInput``): exactly one of ``text`` (str or list of str) or ``input_ids`` (list of
ints or list of lists), ``sampling_params``, ``stream``, ``rid``, ``cache_salt`` (a string for every prompt,
or one per prompt: requests with different salts share no cached KV; ``extra_key``, upstream's name for it, is
taken too and must equal it when both are given: sglang-router 0.3.2 forwards ``extra_key`` and drops
``cache_salt`` on this route; smg forwards both), ``image_data`` (a vision-language
model: an image or a list of images per prompt, ``engine/server/images.py``; the text carries one image
token per image), and upstream's log-probability fields
``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ``token_ids_logprob``,
``return_text_in_logprobs`` (one value for every prompt, or a list with one per prompt; the ``meta_info``
fields are described in ``engine/server/logprob_format.py``). ``sampling_params.n`` > 1 answers a list of n
results per prompt: the prompt is prefilled once (a ``max_new_tokens`` 0 request first), and the n samples
share its KV through the prefix cache; with a ``sampling_seed``, sample ``j`` uses seed + j. Other upstream
fields that routers forward (``log_metrics``, ...) are accepted and have no effect; fields asking for output
this engine cannot produce (``return_hidden_states``, ``input_embeds``) are a 400, and so is
``bootstrap_room`` on a worker that is not in PD mode, or a PD worker's request without valid
``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` (``Engine.bootstrap``; with n > 1, as
sglang-router sends it, a list of n rooms: sample j pairs with room j, and the prompt is not computed ahead).
Text is tokenized on a worker thread, and a non-streaming request whose client disconnects is aborted. The
checked body becomes one ``GenerateRequest`` per prompt (``generate_requests``), which the engine carries
whole to the scheduler.
Response: ``{"text", "output_ids", "meta_info"}`` (a list for batched input). With ``stream`` the events are
SSE frames carrying the cumulative text and ids (upstream default); the text only grows (a tail that could
become a stop string waits for the next frame) and the stream ends with ``data: [DONE]``. A streamed batch
or ``n`` > 1 (each prompt prefilled once before the stream starts) interleaves the frames of all its runs as
they come, each with a top-level ``index`` (prompt-major: prompt i's sample j is ``i * n + j``), as upstream.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.model.vlm.mm import MMItem
from engine.scheduler import SamplingParams
from engine.scheduler.logprobs import LogprobRequest, LogprobValues
from engine.scheduler.req import Bootstrap
from engine.scheduler.request import GenerateRequest
from engine.server.engine import Engine, RequestError
from engine.server.http_utils import SSE_DONE, HTTPError, interleave, json_body, sse, until_disconnect
from engine.server.logprob_format import sglang_meta
from engine.server.schemas import GenerateReqInput, request_body, validated
from engine.server.stream_text import StreamText
from engine.server.tenants import Tenant, authorize, request_salt

router = APIRouter()

_UNSUPPORTED_TRUE = ("return_hidden_states", "return_routed_experts")
_LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob")


def parse_generate(
    engine: Engine, body: dict
) -> tuple[
    list[list[int]], list[SamplingParams], bool, Bootstrap | list[Bootstrap] | None, list[list[MMItem]]
]:
    """Prompts as token ids, one SamplingParams each, whether the input was batched, the PD pairing and each
    prompt's images. ``body`` was checked against ``GenerateReqInput``; text is tokenized and images are
    encoded here (run it off the event loop)."""
    if body.get("input_embeds") is not None:
        raise HTTPError(400, "input_embeds is not supported")
    for name in _UNSUPPORTED_TRUE:
        if body.get(name):
            raise HTTPError(400, f"{name} is not supported")
    try:
        bootstrap = engine.bootstrap(body, _requested_n(body))
    except RequestError as exc:
        raise HTTPError(400, str(exc)) from None
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise HTTPError(400, "give exactly one of 'text' or 'input_ids'")
    if text is not None:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts:
            raise HTTPError(400, "'text' must be a string or a non-empty list of strings")
        prompts = [engine.encode(t) for t in texts]
    else:
        assert ids is not None, "exactly one of text and input_ids is given (checked above)"
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
    prompts, mm = _images_or_fail_room(engine, body.get("image_data"), prompts, batched, bootstrap)
    raw = body.get("sampling_params")
    raws = raw if isinstance(raw, list) else [raw] * len(prompts)
    if len(raws) != len(prompts):
        raise HTTPError(400, "sampling_params list length must match the number of prompts")
    try:
        params = [SamplingParams.from_dict(r) for r in raws]
    except (TypeError, ValueError) as exc:
        raise HTTPError(400, str(exc)) from None
    try:
        for p, sp, items in zip(prompts, params, mm, strict=True):
            engine.check_request(p, sp, bootstrap=bootstrap, mm_items=items)
    except RequestError as exc:
        raise HTTPError(400, str(exc)) from None
    if bootstrap is not None and batched:
        raise HTTPError(400, "bootstrap_room: one prompt per PD request (batched input is not supported)")
    return prompts, params, batched, bootstrap, mm


def _requested_n(body: dict) -> int:
    """The ``sampling_params.n`` of a one-prompt body when it is an integer above 1 (a PD request then
    carries one pairing per sample), else 1 (checked later, with the other sampling values)."""
    raw = body.get("sampling_params")
    n = raw.get("n") if isinstance(raw, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def _images_or_fail_room(
    engine: Engine,
    data,
    prompts: list[list[int]],
    batched: bool,
    bootstrap: Bootstrap | list[Bootstrap] | None,
) -> tuple[list[list[int]], list[list[MMItem]]]:
    """``_images``; on a prefill worker a PD request whose images fail also fails its room (``fail_room``),
    so its decode does not wait for KV."""
    try:
        return _images(engine, data, prompts, batched)
    except HTTPError as exc:
        if bootstrap is not None:
            engine.fail_room(bootstrap, exc.message)
        raise


def _images(
    engine: Engine, data, prompts: list[list[int]], batched: bool
) -> tuple[list[list[int]], list[list[MMItem]]]:
    """``image_data`` (upstream's: a string or list of strings for one prompt; one entry per prompt for a
    batch) applied to the prompts: image tokens expanded, embeddings attached."""
    if data is None:
        return prompts, [[] for _ in prompts]
    if engine.images is None:
        raise HTTPError(400, "image_data: this model takes no images (not a vision-language model)")
    if batched:
        if not isinstance(data, list) or len(data) != len(prompts):
            raise HTTPError(400, "image_data: one entry (an image or a list of images) per prompt")
        per_prompt = [([d] if isinstance(d, str) else d, f"image_data.{i}") for i, d in enumerate(data)]
    else:
        per_prompt = [([data] if isinstance(data, str) else data, "image_data")]
    out_ids, out_items = [], []
    for ids, (sources, field) in zip(prompts, per_prompt, strict=True):
        if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
            raise HTTPError(400, f"{field}: expected an image (a string) or a list of images")
        named = [(f"{field}.{k}" if len(sources) > 1 or batched else field, s) for k, s in enumerate(sources)]
        new_ids, items = engine.images.prepare(list(ids), named, field)
        out_ids.append(new_ids)
        out_items.append(items)
    return out_ids, out_items


def parse_logprobs(engine: Engine, body: dict, prompts: list[list[int]], batched: bool) -> list:
    """One ``LogprobRequest`` (or None) per prompt from upstream's fields; ``HTTPError(400)`` names a bad
    one."""
    per_prompt = {name: _per_prompt(body, name, len(prompts), batched) for name in _LOGPROB_FIELDS}
    out: list[LogprobRequest | None] = []
    for i, prompt in enumerate(prompts):
        if not per_prompt["return_logprob"][i]:
            out.append(None)
            continue
        try:
            want = LogprobRequest.resolve(
                len(prompt),
                per_prompt["logprob_start_len"][i],
                per_prompt["top_logprobs_num"][i],
                per_prompt["token_ids_logprob"][i],
            )
        except ValueError as exc:
            raise HTTPError(400, str(exc)) from None
        if want.top_n > engine.vocab_size:
            raise HTTPError(400, f"top_logprobs_num must be <= the vocabulary size ({engine.vocab_size})")
        if any(t >= engine.vocab_size for t in want.token_ids or ()):
            raise HTTPError(400, f"token_ids_logprob must be token ids in [0, {engine.vocab_size})")
        out.append(want)
    return out


def _per_prompt(body: dict, name: str, n: int, batched: bool) -> list:
    """``body[name]`` for each of ``n`` prompts: one value for all, or (batched) a list of n values.
    ``token_ids_logprob`` is itself a list: a list of lists is per prompt."""
    value = body.get(name)
    per = isinstance(value, list) and (name != "token_ids_logprob" or (value and isinstance(value[0], list)))
    if not per:
        return [value] * n
    assert isinstance(value, list), "per is only true for a list"
    if batched and len(value) == n:
        return list(value)
    raise HTTPError(400, f"{name}: a list needs one value per prompt")


def _salts(body: dict, n: int, batched: bool) -> list[str | None]:
    """One salt per prompt from ``cache_salt`` or, failing that, ``extra_key`` (upstream's name, and the one
    sglang-router 0.3.2 forwards on /generate): a string applies to every prompt; a list needs one per prompt.
    Both given and different: ``HTTPError(400)`` naming both (never the values)."""
    salt, key = body.get("cache_salt"), body.get("extra_key")
    if salt is not None and key is not None and salt != key:
        raise HTTPError(400, "cache_salt and extra_key differ: give one (they name the same cache key space)")
    field = "cache_salt" if salt is not None or key is None else "extra_key"
    salt = salt if salt is not None else key
    if not isinstance(salt, list):
        return [salt] * n
    if batched and len(salt) == n:
        return list(salt)
    raise HTTPError(400, f"{field} must be a string or a list of strings, one per prompt")


def _rids(rid, n: int, batched: bool) -> list[str | None]:
    """Request ids: a string for one prompt, a list of n strings for a batch (upstream); else generated."""
    if rid is None:
        return [None] * n
    if not batched and isinstance(rid, str):
        return [rid]
    if batched and isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) for r in rid):
        return list(rid)
    raise HTTPError(400, "rid must be a string (one prompt) or a list of strings, one per prompt")


def _response(engine: Engine, request: GenerateRequest, res: dict, return_text: bool) -> dict:
    """One result of ``Engine.generate_n`` in upstream's shape: ``{"text", "output_ids", "meta_info"}``."""
    ids, reason = res["output_ids"], res["finish_reason"]
    meta = dict(res["meta"], finish_reason=reason)
    if request.logprob is not None:
        meta.update(
            sglang_meta(engine, request.logprob, res["logprobs"], request.input_ids, ids, return_text)
        )
    return {
        "text": engine.output_text(ids, request.params, reason),
        "output_ids": list(ids),
        "meta_info": meta,
    }


async def generate_requests(
    engine: Engine, body: dict, tenant: Tenant | None
) -> tuple[list[GenerateRequest], bool]:
    """The requests of a ``/generate`` body (checked against ``GenerateReqInput``), one per prompt, and
    whether the input was batched: prompts tokenized and images prepared (on a worker thread), sampling
    values checked, log-probability fields resolved, rids and salts (the tenant's, ``tenant_salt``) per
    prompt, grammars compiled. ``HTTPError(400)`` names the field at fault; a PD decode worker also refuses
    the room at its prefill when the grammar does not compile (``Engine.refuse_room``)."""
    prompts, params, batched, bootstrap, mm = await asyncio.to_thread(parse_generate, engine, body)
    wants = parse_logprobs(engine, body, prompts, batched)
    rids = _rids(body.get("rid"), len(prompts), batched)
    salts = [request_salt(engine, tenant, s) for s in _salts(body, len(prompts), batched)]
    try:
        grammars = await asyncio.gather(*(engine.compile_grammar(sp) for sp in params))
    except RequestError as exc:
        if bootstrap is not None:
            engine.refuse_room(bootstrap, str(exc))
        raise HTTPError(400, str(exc)) from None
    if any(sp.n > 1 for sp in params) and any(r is not None for r in rids):
        raise HTTPError(400, "rid: give no rid with sampling_params.n > 1 (each sample is its own request)")
    requests = [
        GenerateRequest(
            prompts[i],
            params[i],
            rid=rids[i],
            bootstrap=bootstrap,
            cache_salt=salts[i],
            mm_items=mm[i],
            logprob=wants[i],
            grammar=grammars[i],
        )
        for i in range(len(prompts))
    ]
    return requests, batched


@router.post("/generate", openapi_extra=request_body(GenerateReqInput))
async def generate(request: Request):
    tenant = authorize(request)
    engine: Engine = request.app.state.engine
    body = validated(GenerateReqInput, await json_body(request))
    requests, batched = await generate_requests(engine, body, tenant)
    return_text = bool(body.get("return_text_in_logprobs"))
    multi = any(r.params.n > 1 for r in requests)
    if body.get("stream"):
        if not (batched or multi):
            frames = _frames(engine, requests[0], return_text)
            return StreamingResponse(_stream(frames), media_type="text/event-stream")
        if multi:  # each prompt's KV computed once, before its samples start (not for a PD request)
            warm = (engine.prefill_once(r) for r in requests if r.params.n > 1)
            for res in await until_disconnect(request, asyncio.gather(*warm)):
                if res is not None:
                    reason = res["finish_reason"]
                    raise HTTPError(reason.get("status_code", 500), reason.get("message", "request aborted"))
        streams = [_frames(engine, s, return_text) for r in requests for s in r.samples()]
        return StreamingResponse(_stream(interleave(streams), indexed=True), media_type="text/event-stream")

    results = await until_disconnect(request, asyncio.gather(*(engine.generate_n(r) for r in requests)))
    out = []
    for req, group in zip(requests, results, strict=True):
        for res in group:
            reason = res["finish_reason"]
            if reason and reason.get("type") == "abort":
                raise HTTPError(reason.get("status_code", 500), reason.get("message", "request aborted"))
            out.append(_response(engine, req, res, return_text))
    return JSONResponse(out if batched or multi else out[0])


async def _stream(frames, indexed: bool = False):
    """SSE frames of ``frames`` (one run's frame dicts, or with ``indexed`` the ``(index, frame)`` pairs of
    several runs: each frame then carries its run's ``index``, prompt-major then sample, as upstream), ending
    with ``[DONE]``; the first error frame ends the stream (the other runs are aborted)."""
    async for item in frames:
        frame = {**item[1], "index": item[0]} if indexed else item
        yield sse(frame)
        if "error" in frame:
            break
    yield SSE_DONE


async def _frames(engine: Engine, request: GenerateRequest, return_text: bool):
    """One frame dict per scheduler event of one-sample ``request``: all ids so far and the monotonic text
    (``StreamText``), and the log-probabilities so far when ``request.logprob`` asks; an abort yields an
    ``error`` frame and ends it."""
    ids: list[int] = []
    meta: dict = {}
    text = StreamText(engine, request.params)
    want = request.logprob
    values = {"input": LogprobValues(), "output": LogprobValues()}
    async for ev in engine.stream(request):
        ids.extend(ev.new_ids)
        meta.update(ev.meta)
        if want is not None and ev.logprobs is not None:
            values["input"].extend(ev.logprobs["input"])
            values["output"].extend(ev.logprobs["output"])
            meta.update(sglang_meta(engine, want, values, request.input_ids, ids, return_text))
        if ev.finish_reason and ev.finish_reason.get("type") == "abort":
            reason = ev.finish_reason
            yield {
                "error": {"message": reason.get("message", "aborted"), "code": reason.get("status_code", 500)}
            }
            return
        text.push(ev.new_ids, ev.finish_reason)
        yield {
            "text": text.text,
            "output_ids": list(ids),
            "meta_info": dict(meta, finish_reason=ev.finish_reason),
        }
