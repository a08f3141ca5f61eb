"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

Mirrors SGLang's adapter: OpenAI fields map to SamplingParams (``max_tokens``/``max_completion_tokens`` ->
``max_new_tokens``, ``seed`` -> ``sampling_seed``, ``min_tokens`` -> ``min_new_tokens``) and SGLang extras
(``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``, ...) pass through. The chat route applies the
model's chat template with ``add_generation_prompt`` (``chat_template_kwargs`` may turn it off). As upstream,
``model`` is not checked (one model is served). ``usage.prompt_tokens_details.cached_tokens`` is filled only
with ``--enable-cache-report`` (upstream). Streams send ``text_completion`` / ``chat.completion.chunk``
objects with text deltas, an optional usage chunk (``stream_options.include_usage``) and ``data: [DONE]``.
Bodies are checked against ``schemas.CompletionRequest`` / ``ChatCompletionRequest`` (a wrong type is a 400
naming the field; a chat role outside upstream's is a 400 naming ``messages.<i>.role``); a bad sampling value
is a 400 naming the client's field (``max_tokens`` or ``max_completion_tokens``, ``n``, ``seed``, ...), not
the SamplingParams one, and ``/v1/completions``' context-length error speaks of the prompt where the chat
route's keeps upstream's "input messages". Prompts are tokenized and chat templates rendered on a worker
thread, ``bootstrap_room`` is refused on a worker not in PD mode, and a non-streaming request whose client
disconnects is aborted. ``cache_salt`` puts the request in its own cache key space (requests with different
salts share no cached KV).
Log-probabilities: chat ``logprobs`` (bool) with ``top_logprobs`` (0..20, needs ``logprobs``), completions
``logprobs`` (an int, 0..20: the top log-probabilities per token) and, with ``echo``, the prompt's tokens
first (the first one's logprob null), in OpenAI's shapes (``engine/server/logprob_format.py``). ``n`` > 1
answers n choices: the prompt is computed once and the n samples reuse its KV through the prefix cache, so
``usage.prompt_tokens_details.cached_tokens`` (summed over the choices, as upstream) shows it;
``prompt_tokens`` counts each prompt once. Streamed, the n samples' chunks interleave, each carrying one
choice and its ``index``. ``/v1/completions`` takes a list of prompts (strings or token-id lists): choices
come prompt-major (prompt i's sample j is ``i * n + j``), streamed or not. Completions' ``suffix`` builds a
fill-in-the-middle prompt from the tokenizer's FIM tokens, or is a 400 saying the model has none.
Penalties, ``min_tokens``, ``logit_bias`` and ``stop_regex`` pass through to SamplingParams. The checked
body becomes one ``GenerateRequest`` per prompt (``completion_requests``, ``chat_request``), which the engine
carries whole to the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from typing import TYPE_CHECKING, NamedTuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.grammar.tool_parsers import default_parser, get_parser
from engine.grammar.tools import Tools, ToolStream, parse_tools
from engine.model.vlm.mm import MMItem
from engine.scheduler import SamplingParams
from engine.scheduler.logprobs import LogprobRequest, LogprobValues
from engine.scheduler.req import Bootstrap
from engine.scheduler.request import GenerateRequest
from engine.server.engine import Engine, RequestError
from engine.server.http_utils import SSE_DONE, HTTPError, interleave, json_body, sse, until_disconnect
from engine.server.logprob_format import openai_chat, openai_completion
from engine.server.schemas import ChatCompletionRequest, CompletionRequest, request_body, validated
from engine.server.stream_text import StreamText
from engine.server.structured import response_format, tool_message
from engine.server.tenants import Tenant, authorize, request_salt

if TYPE_CHECKING:
    import xgrammar as xgr

router = APIRouter()

# OpenAI / SGLang request field -> SamplingParams field.
_PARAM_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "seed": "sampling_seed",
    "n": "n",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
    "logit_bias": "logit_bias",
    "stop_regex": "stop_regex",
}
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat ``top_logprobs`` (and here for completions' ``logprobs``)
# Fill-in-the-middle tokens (prefix, suffix, middle) of the model families that have them.
_FIM_TOKENS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<PRE>", "<SUF>", "<MID>"),
)


def _sampling_params(
    engine: Engine,
    body: dict,
    prompt: list[int],
    max_tokens_field: str,
    source: str,
    bootstrap: Bootstrap | list[Bootstrap] | None = None,
    mm_items: list[MMItem] | None = None,
    tools: Tools | None = None,
) -> tuple[SamplingParams, dict[str, str]]:
    """SamplingParams of an OpenAI body and the client's names of their fields; a bad value is
    ``HTTPError(400)`` naming the client's field (``max_tokens``, or ``max_completion_tokens`` on chat when
    that was sent; ``n``, ``seed``, ``response_format``, ...), and the context-length error calls the prompt
    ``source``. ``response_format`` and a tool choice that constrains the output become its grammar."""
    raw = {dst: body[src] for src, dst in _PARAM_FIELDS.items() if body.get(src) is not None}
    max_tokens = body.get(max_tokens_field)
    raw["max_new_tokens"] = engine.default_max_new_tokens(prompt) if max_tokens is None else max_tokens
    names = {dst: src for src, dst in _PARAM_FIELDS.items()} | {"max_new_tokens": max_tokens_field}
    try:
        constraint = response_format(body.get("response_format"))
        if tools is not None and tools.constrained:
            if constraint:
                raise ValueError(
                    "response_format: give no JSON format with tool_choice required or a function"
                )
            schema = tools.json_schema()
            assert schema is not None, "a constrained tool choice has a schema (only auto has none)"
            constraint = {"json_schema": (schema, "tools")}
        for key, (text, name) in (constraint or {}).items():
            raw[key], names[key] = text, name
        params = SamplingParams.from_dict(raw, names)
        engine.check_request(prompt, params, names, source, bootstrap, mm_items or ())
    except (TypeError, ValueError) as exc:
        raise HTTPError(400, str(exc)) from None
    return params, names


async def _compile(
    engine: Engine,
    params: SamplingParams,
    names: dict[str, str],
    bootstrap: Bootstrap | list[Bootstrap] | None,
) -> xgr.CompiledGrammar | None:
    """The request's compiled grammar (``Engine.compile_grammar``; None when unconstrained);
    ``HTTPError(400)`` naming the field when it does not compile (a PD decode worker also refuses the room
    of ``bootstrap`` at its prefill)."""
    try:
        return await engine.compile_grammar(params, names)
    except RequestError as exc:
        if bootstrap is not None:
            engine.refuse_room(bootstrap, str(exc))
        raise HTTPError(400, str(exc)) from None


def _include_usage(body: dict) -> bool:
    """``stream_options.include_usage`` (default false); ``HTTPError(400)`` for a malformed value."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise HTTPError(400, "stream_options must be an object")
    include = options.get("include_usage", False)
    if not isinstance(include, bool | None):
        raise HTTPError(400, "stream_options.include_usage must be a boolean")
    return bool(include)


def _finish(reason: dict | None) -> tuple[str | None, object]:
    if reason is None:
        return None, None
    kind = reason.get("type")
    return ("stop" if kind == "stop" else "length" if kind == "length" else "abort"), reason.get("matched")


def _usage_n(engine: Engine, prompts: list[list[int]], results: list[tuple[int, dict]]) -> dict:
    """Usage of the choices ``results`` (``(prompt index, result)``) of ``prompts`` (upstream): each prompt
    counted once, the completions and the cached tokens summed over the choices."""
    n_out = sum(len(r["output_ids"]) for _, r in results)
    cached = sum(r["meta"].get("cached_tokens", 0) for _, r in results)
    n_in = sum(len(ids) for ids in prompts)
    usage: dict[str, object]
    usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
    if engine.args.enable_cache_report:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _top_logprobs(body: dict, field: str, allowed: bool) -> int:
    """The number of top log-probabilities ``body[field]`` asks for (0..``MAX_TOP_LOGPROBS``);
    ``HTTPError(400)`` naming ``field`` otherwise, or when given while ``allowed`` is false."""
    value = body.get(field)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise HTTPError(400, f"{field} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")
    if not allowed:
        raise HTTPError(400, f"{field} requires logprobs to be true")
    return value


def _fim_prompt(engine: Engine, prompt: str, suffix: str) -> str:
    """``prompt`` and ``suffix`` in the model's fill-in-the-middle format; ``HTTPError(400)`` naming suffix
    when its tokenizer has no fill-in-the-middle tokens."""
    vocab = engine.tokenizer.get_vocab() if hasattr(engine.tokenizer, "get_vocab") else {}
    for pre, suf, mid in _FIM_TOKENS:
        if pre in vocab and suf in vocab and mid in vocab:
            return f"{pre}{prompt}{suf}{suffix}{mid}"
    raise HTTPError(400, "suffix is not supported: the model's tokenizer has no fill-in-the-middle tokens")


# ---------------------------------------------------------------------------------------------- completions
def _requested_n(body: dict) -> int:
    """``n`` when it is an integer above 1 (a PD request then carries one pairing per sample), else 1
    (checked later, with the other sampling values)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def _pairing_and_salt(
    engine: Engine, body: dict, tenant: Tenant | None
) -> tuple[Bootstrap | list[Bootstrap] | None, str | None]:
    """The PD pairing a body carries (``Engine.bootstrap``: one per sample for n > 1) and the cache salt it
    runs in (the tenant's, when its API key names one); ``HTTPError(400)`` naming a bad pairing field."""
    try:
        bootstrap = engine.bootstrap(body, _requested_n(body))
        return bootstrap, request_salt(engine, tenant, body.get("cache_salt"))
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from None


def _prompt_list(prompt, suffix) -> list[str | list[int]]:
    """The prompts of a completions body: a string, a list of token ids, or a non-empty list of either;
    ``HTTPError(400)`` naming ``prompt`` (or ``suffix`` with token prompts) otherwise."""
    texts = isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)
    ids = isinstance(prompt, list) and all(
        isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt
    )
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    elif prompt and (texts or ids):
        prompts = list(prompt)
    else:
        raise HTTPError(400, "'prompt' must be a string, a list of token ids, or a non-empty list of either")
    if suffix and not all(isinstance(p, str) for p in prompts):
        raise HTTPError(400, "suffix needs a text prompt")
    return prompts


@dataclasses.dataclass
class _Run:
    """One streamed choice: its prompt's index, its one-sample request, the opening choice (``first``,
    without its index) and, on a chat that may call tools, its own ``ToolStream``; it counts its output
    tokens and keeps its meta as it streams."""

    prompt: int
    request: GenerateRequest
    first: dict | None = None
    tool_stream: ToolStream | None = None
    n_out: int = 0
    meta: dict = dataclasses.field(default_factory=dict)


def _runs(requests: list[GenerateRequest], **fields) -> list[_Run]:
    """The streamed choices of ``requests`` (one per prompt), prompt-major then sample (OpenAI's choice
    order): each request's ``samples()`` (one PD pairing per sample for a PD request with n > 1); ``fields``
    maps a ``_Run`` field to a function of (prompt index, sample index) giving its value."""
    return [
        _Run(i, one, **{k: f(i, j) for k, f in fields.items()})
        for i, r in enumerate(requests)
        for j, one in enumerate(r.samples())
    ]


async def _prefill_once(request: Request, engine: Engine, requests: list[GenerateRequest]) -> None:
    """Before streaming n > 1 samples: compute each such prompt's KV once (``Engine.prefill_once``, which
    runs nothing for a PD request); ``HTTPError`` with the abort's status when the scheduler refused it."""
    warm = (engine.prefill_once(r) for r in requests if r.params.n > 1)
    for res in await until_disconnect(request, asyncio.gather(*warm)):
        if res is not None:
            _check_abort(res["finish_reason"])


class _Completions(NamedTuple):
    """A completions body's requests (one per prompt, in order), its prompts as the client sent them (text
    with ``suffix`` in the fill-in-the-middle format, or token ids) and whether the prompt is echoed."""

    requests: list[GenerateRequest]
    texts: list[str | list[int]]
    echo: bool


async def completion_requests(engine: Engine, body: dict, tenant: Tenant | None) -> _Completions:
    """The requests of a ``/v1/completions`` body (checked against ``CompletionRequest``), built once:
    prompts tokenized (on a worker thread), sampling values checked (``max_tokens`` named as the client's
    field; ``prompt.<i>: `` prefixed with several prompts), the grammar compiled, the log-probabilities
    resolved (``echo``: from the first prompt token), the PD pairing and the salt (the tenant's).
    ``HTTPError(400)`` names the field at fault."""
    bootstrap, salt = _pairing_and_salt(engine, body, tenant)
    suffix = body.get("suffix")
    texts = _prompt_list(body["prompt"], suffix)
    if bootstrap is not None and len(texts) > 1:
        raise HTTPError(400, "prompt: one prompt per PD request (a list of prompts is not supported)")
    if suffix:
        texts = [_fim_prompt(engine, t, suffix) for t in texts]  # type: ignore[arg-type]
    prompts = await asyncio.to_thread(
        lambda: [engine.encode(t) if isinstance(t, str) else list(t) for t in texts]
    )
    names: dict[str, str]
    params, names = [], {}
    for i, ids in enumerate(prompts):
        try:
            sp, names = _sampling_params(engine, body, ids, "max_tokens", "the prompt", bootstrap)
        except HTTPError as exc:
            message = f"prompt.{i}: {exc.message}" if len(prompts) > 1 else exc.message
            raise HTTPError(exc.status, message) from None
        params.append(sp)
    grammar = await _compile(engine, params[0], names, bootstrap)
    echo = bool(body.get("echo")) and not suffix
    top = _top_logprobs(body, "logprobs", True)
    wants: list[LogprobRequest | None] = [None] * len(prompts)
    if body.get("logprobs") is not None:
        wants = [LogprobRequest(0 if echo else len(ids) - 1, top) for ids in prompts]
    requests = [
        GenerateRequest(ids, sp, bootstrap=bootstrap, cache_salt=salt, logprob=want, grammar=grammar)
        for ids, sp, want in zip(prompts, params, wants, strict=True)
    ]
    return _Completions(requests, texts, echo)


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
async def completions(request: Request):
    tenant = authorize(request)
    engine: Engine = request.app.state.engine
    body = validated(CompletionRequest, await json_body(request))
    requests, texts, echo = await completion_requests(engine, body, tenant)
    echo_texts = [
        (t if isinstance(t, str) else engine.decode(r.input_ids)) if echo else ""
        for t, r in zip(texts, requests, strict=True)
    ]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": engine.model_name}
    if body.get("stream"):
        include_usage = _include_usage(body)
        await _prefill_once(request, engine, requests)
        return StreamingResponse(
            _stream_completion(engine, requests, base, echo_texts, include_usage),
            media_type="text/event-stream",
        )
    groups = await until_disconnect(request, asyncio.gather(*(engine.generate_n(r) for r in requests)))
    choices: list[dict]
    choices, results = [], []
    for i, group in enumerate(groups):
        ids, want = requests[i].input_ids, requests[i].logprob
        for res in group:
            finish, matched = _check_abort(res["finish_reason"])
            text = engine.output_text(res["output_ids"], requests[i].params, res["finish_reason"])
            logprobs = None
            if want is not None:
                values = res["logprobs"]
                inp = values["input"] if echo else None
                logprobs = openai_completion(engine, inp, ids, values["output"], res["output_ids"], 0)
            choices.append(
                {
                    "index": len(choices),
                    "text": echo_texts[i] + text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "matched_stop": matched,
                }
            )
            results.append((i, res))
    prompts = [r.input_ids for r in requests]
    return JSONResponse({**base, "choices": choices, "usage": _usage_n(engine, prompts, results)})


def _check_abort(reason: dict | None) -> tuple[str | None, object]:
    finish, matched = _finish(reason)
    if finish == "abort":
        reason = reason or {}
        raise HTTPError(reason.get("status_code", 500), reason.get("message", "request aborted"))
    return finish, matched


async def _stream_choices(
    engine: Engine,
    prompts: list[list[int]],
    runs: list[_Run],
    base: dict,
    content,
    include_usage: bool,
    render=None,
):
    """The SSE chunks of a streamed request whose choices are ``runs`` (choice ``index`` = position in
    ``runs``): each run's opening choice (when it has one), then as they come a chunk per text delta of one
    choice carrying ``content(text)`` (``text`` or ``delta``), an error chunk on the first abort (which ends
    the stream and aborts the other choices), the optional usage chunk (each of ``prompts`` counted once,
    completions and cached tokens summed over the choices), then ``[DONE]``. When a run's request asks
    for log-probabilities, each chunk's ``logprobs`` is ``render(prompt ids, values, new ids)`` of the
    tokens not reported by an earlier chunk. A chat choice that may call tools (``tool_stream``) sends its
    deltas instead: content as it comes, tool calls at the end (finish reason ``tool_calls``)."""
    for index, run in enumerate(runs):
        if run.first is not None:
            yield sse({**base, "choices": [{"index": index, **run.first}]})
    streams = [_run_choices(engine, run, content, render) for run in runs]
    async for index, choice in interleave(streams):
        if "error" in choice:
            yield sse(choice)
            break
        yield sse({**base, "choices": [{**choice, "index": index}]})
    if include_usage:
        results = [(run.prompt, {"output_ids": range(run.n_out), "meta": run.meta}) for run in runs]
        yield sse({**base, "choices": [], "usage": _usage_n(engine, prompts, results)})
    yield SSE_DONE


async def _run_choices(engine: Engine, run: _Run, content, render):
    """The choices (without ``index``) one streamed run sends, or one ``{"error": ...}`` on abort; counts
    its output tokens and keeps its meta in ``run``."""
    delta = StreamText(engine, run.request.params)
    pending, pending_ids = LogprobValues(), []
    async for ev in engine.stream(run.request):
        run.n_out += len(ev.new_ids)
        run.meta.update(ev.meta)
        if ev.logprobs is not None:
            pending.extend(ev.logprobs["output"])
            pending_ids += ev.new_ids
        finish, matched = _finish(ev.finish_reason)
        if finish == "abort":
            reason = ev.finish_reason
            assert reason is not None, "an abort is a finish"
            yield {
                "error": {"message": reason.get("message", "aborted"), "code": reason.get("status_code", 500)}
            }
            return
        text = delta.push(ev.new_ids, ev.finish_reason)
        if run.tool_stream is not None:
            for chunk in _tool_chunks(run.tool_stream, text, finish, matched):
                yield chunk
            continue
        if text or finish:
            logprobs = None
            if run.request.logprob is not None and render is not None:
                logprobs = render(run.request.input_ids, pending, pending_ids)
                pending, pending_ids = LogprobValues(), []
            yield {**content(text), "logprobs": logprobs, "finish_reason": finish, "matched_stop": matched}


def _tool_chunks(tool_stream: ToolStream, text: str, finish: str | None, matched) -> list[dict]:
    """The choices one stream event sends when tools may be called (``ToolStream``)."""
    deltas = tool_stream.push(text) + (tool_stream.finish() if finish else [])
    chunks: list[dict] = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    if finish:
        finish = "tool_calls" if tool_stream.calls else finish
        chunks.append(
            {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
        )
    return chunks


def _stream_completion(
    engine: Engine,
    requests: list[GenerateRequest],
    base: dict,
    echo_texts: list[str],
    include_usage: bool,
):
    """Completion chunks of ``requests`` (one per prompt); with ``logprobs`` each carries its tokens' (the
    echoed prompt's are not streamed: a streamed echo sends the prompt text only, and its request asks for
    the output's log-probabilities only)."""

    def first(i, j):
        return {"text": echo_texts[i], "logprobs": None, "finish_reason": None} if echo_texts[i] else None

    def render(ids, values, new_ids):
        return openai_completion(engine, None, ids, values, new_ids, 0)

    streamed = [
        r
        if r.logprob is None
        else dataclasses.replace(r, logprob=LogprobRequest(len(r.input_ids) - 1, r.logprob.top_n))
        for r in requests
    ]
    runs = _runs(streamed, first=first)
    content = lambda text: {"text": text}  # noqa: E731
    prompts = [r.input_ids for r in requests]
    return _stream_choices(engine, prompts, runs, base, content, include_usage, render)


# ---------------------------------------------------------------------------------------------- chat
# Template variables the server fills in itself (``chat_template_kwargs`` may not set them).
_RESERVED_TEMPLATE_VARS = {"messages", "bos_token", "eos_token"}


def _chat_prompt(engine: Engine, body: dict, tools: Tools | None = None) -> tuple[list[int], list[MMItem]]:
    """Token ids of the rendered chat and its images, ``tools``' functions passed to the template (upstream);
    ``body`` was checked against ``ChatCompletionRequest`` (run it off the event loop: the template renders,
    the text is tokenized and images are encoded here)."""
    messages = body["messages"]
    images: list[tuple[str, str]] = []  # (field, url) in prompt order
    for i, m in enumerate(messages):
        _tool_turn(m)
        if not isinstance(m["content"], list):
            continue
        parts = m["content"]
        if not any(p["type"] == "image_url" for p in parts):  # text content parts
            m["content"] = "".join(p.get("text", "") for p in parts)
            continue
        if engine.images is None:
            raise HTTPError(400, f"messages.{i}.content: image_url parts need a vision-language model")
        for j, p in enumerate(parts):
            if p["type"] == "image_url":
                images.append((f"messages.{i}.content.{j}.image_url.url", p["image_url"]["url"]))
        m["content"] = [p if p["type"] == "text" else {"type": "image"} for p in parts]
    cont = bool(body.get("continue_final_message")) and messages[-1].get("role") == "assistant"
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise HTTPError(400, "chat_template_kwargs must be an object")
    kwargs = dict(kwargs)
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_VARS)
    if reserved:
        raise HTTPError(400, f"chat_template_kwargs: {', '.join(reserved)} is set by the server")
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise HTTPError(400, "chat_template_kwargs.add_generation_prompt must be a boolean")
    if tools is not None:
        kwargs.setdefault("tools", tools.functions)
    try:
        ids = engine.chat_prompt(
            messages, continue_final_message=cont, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except ValueError as exc:  # template errors (bad roles, missing fields) are the client's
        raise HTTPError(400, str(exc)) from None
    if not images:
        return ids, []
    assert engine.images is not None
    return engine.images.prepare(ids, images, "messages")


def _tool_turn(message: dict) -> None:
    """An assistant turn that only called tools has content ""; its calls' arguments become objects, as
    templates read them."""
    if message.get("content") is None:
        message["content"] = ""
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            with contextlib.suppress(ValueError):
                function["arguments"] = json.loads(function["arguments"])


async def chat_request(
    engine: Engine, body: dict, tenant: Tenant | None
) -> tuple[GenerateRequest, Tools | None]:
    """The request of a ``/v1/chat/completions`` body (checked against ``ChatCompletionRequest``), built
    once, and its tools: the chat rendered with the model's template and tokenized, images prepared (on a
    worker thread), sampling values checked (``max_tokens`` or ``max_completion_tokens`` named as sent), the
    grammar (``response_format``, or a tool choice that constrains the output) compiled, the
    log-probabilities resolved, the PD pairing and the salt (the tenant's). ``HTTPError(400)`` names the
    field at fault; a PD prefill worker also fails the room when the chat cannot be prepared, a decode
    worker refuses it at its prefill when the request is refused."""
    bootstrap, salt = _pairing_and_salt(engine, body, tenant)
    try:
        tools = parse_tools(body.get("tools"), body.get("tool_choice"))
    except ValueError as exc:
        raise HTTPError(400, str(exc)) from None
    try:
        ids, mm_items = await asyncio.to_thread(_chat_prompt, engine, body, tools)
    except HTTPError as exc:
        if bootstrap is not None:
            engine.fail_room(bootstrap, exc.message)
        raise
    sent = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params, names = _sampling_params(
        engine, body, ids, sent, "the input messages", bootstrap, mm_items, tools
    )
    grammar = await _compile(engine, params, names, bootstrap)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise HTTPError(400, f"logprobs must be a boolean, got {logprobs!r}")
    top = _top_logprobs(body, "top_logprobs", bool(logprobs))
    want = LogprobRequest(len(ids) - 1, top) if logprobs else None
    request = GenerateRequest(
        ids,
        params,
        bootstrap=bootstrap,
        cache_salt=salt,
        mm_items=mm_items,
        logprob=want,
        grammar=grammar,
    )
    return request, tools


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def chat_completions(request: Request):
    tenant = authorize(request)
    engine: Engine = request.app.state.engine
    body = validated(ChatCompletionRequest, await json_body(request))
    req, tools = await chat_request(engine, body, tenant)
    parser = get_parser(engine.args.tool_call_parser or default_parser(engine.tokenizer.chat_template))
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "chat.completion", "created": created, "model": engine.model_name}
    if body.get("stream"):
        include_usage = _include_usage(body)
        base["object"] = "chat.completion.chunk"
        await _prefill_once(request, engine, [req])
        return StreamingResponse(
            _stream_chat(engine, req, base, include_usage, tools, parser),
            media_type="text/event-stream",
        )
    results = await until_disconnect(request, engine.generate_n(req))
    choices = []
    for j, res in enumerate(results):
        finish, matched = _check_abort(res["finish_reason"])
        text = engine.output_text(res["output_ids"], req.params, res["finish_reason"])
        message, finish = tool_message(text, tools, parser, finish)
        choice_logprobs = None
        if req.logprob is not None:
            choice_logprobs = openai_chat(engine, res["logprobs"]["output"], res["output_ids"])
        choices.append(
            {
                "index": j,
                "message": message,
                "logprobs": choice_logprobs,
                "finish_reason": finish,
                "matched_stop": matched,
            }
        )
    usage = _usage_n(engine, [req.input_ids], [(0, res) for res in results])
    return JSONResponse({**base, "choices": choices, "usage": usage})


def _tool_stream(tools: Tools | None, parser) -> ToolStream | None:
    return None if tools is None else ToolStream(tools, parser)


def _stream_chat(
    engine: Engine,
    request: GenerateRequest,
    base: dict,
    include_usage: bool,
    tools: Tools | None,
    parser,
):
    """Chat chunks of ``request``'s samples: each choice opens with the assistant role, then its content
    deltas (or tool-call deltas, each choice with its own ``ToolStream``)."""
    first = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def render(_ids, values, new_ids):
        return openai_chat(engine, values, new_ids)

    runs = _runs([request], first=lambda i, j: first, tool_stream=lambda i, j: _tool_stream(tools, parser))
    prompts = [request.input_ids]
    return _stream_choices(engine, prompts, runs, base, _chat_delta, include_usage, render)


def _chat_delta(text: str) -> dict:
    return {"delta": {"content": text} if text else {}}


# ---------------------------------------------------------------------------------------------- models
@router.get("/v1/models")
async def models(request: Request):
    authorize(request)
    engine: Engine = request.app.state.engine
    card = {
        "id": engine.model_name,
        "object": "model",
        "created": int(engine.started_at),
        "owned_by": "sglang",
        "root": engine.args.model_path,
        "max_model_len": engine.context_length,
    }
    return JSONResponse({"object": "list", "data": [card]})
