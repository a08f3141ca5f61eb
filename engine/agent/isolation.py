"""An isolation self-test against a live worker or router (``kvfleet-agent check-isolation URL``).

One prompt no one has sent before (a random nonce first), three requests, one at a time: salt A (cold), salt B
(must reuse nothing: 0 cached tokens in every tier), salt A again (must reuse the prompt's cached pages). Both
salts are fresh random values, so the check never reads or pollutes a real tenant's cache. A route passes when
B got no cached token, A's second request got some, and all three answered the same greedy output. TTFTs are
the worker's ``meta_info.ttft`` on ``/generate`` (seconds from arrival to first token).

The salt goes as ``cache_salt`` only, the field a tenant sends, so a router that drops it on the way fails
the check rather than passing it. A URL whose ``GET /get_loads`` answers as a router's is identified
(engine/fleet/identity.py: smg with its version, or sglang-router) and checked on each serving route that
takes a salt (``/generate``, ``/v1/completions``, ``/v1/chat/completions``: sglang-router 0.3.2 drops it on
``/generate`` and chat, smg 1.13.0 on none), each with its own prompt; a worker is checked on ``/generate``.
A router is asked for its workers (``GET /workers``): with exactly one the result stands; with more the
three requests may land on different workers, so "salt B reused nothing" proves nothing and the check is
inconclusive (``ok`` False, ``inconclusive`` True) rather than passed. Reuse by salt B is a failure wherever
it lands, and through a router its problem names the router and the supported way (tenant API keys).

A worker whose ``/server_info`` says ``grpc_mode`` (its URL is then its HTTP sidecar) is not probed: tenants
reach it through the router over gRPC, where no salt and no API key travels, so whatever the sidecar's HTTP
routes do with a salt, it cannot keep tenants apart. The report says so (``not_isolatable``, ``ok`` False,
no probes) with the supported way.
"""

from __future__ import annotations

import random
import secrets
from dataclasses import asdict, dataclass, field

import httpx

from engine.fleet.identity import SALT_ROUTES, TENANT_KEYS_ADVICE, grpc_isolation_problem, identify_router

WORDS = (
    "river",
    "stone",
    "quiet",
    "lamp",
    "orbit",
    "cedar",
    "velvet",
    "harbor",
    "copper",
    "meadow",
    "signal",
    "lantern",
)


class IsolationCheckError(Exception):
    """The URL could not be checked (unreachable, a non-200 answer); the message says which, ``status`` is
    the HTTP status (None: it did not answer)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class Probe:
    salt: str  # "A" or "B", never the salt itself
    cached: dict  # cached tokens: per tier (device, host, storage) on /generate, {"total": n} on /v1/*
    # ({} there when the worker does not report them: it runs without --enable-cache-report)
    ttft_s: float  # the worker's meta_info.ttft on /generate; 0.0 on /v1/* (not reported there)
    output_ids: list  # greedy output token ids on /generate; [text] on /v1/*


@dataclass
class IsolationReport:
    ok: bool
    prompt_tokens: int  # of /generate's prompt (0: not probed)
    probes: list  # of Probe on /generate: A cold, B, A again ([]: not probed, a not_isolatable worker)
    problems: list  # sentences, empty when ok
    router_workers: int | None = None  # URL is a router: workers it lists; None: a worker
    inconclusive: bool = False  # nothing reused, but the router may have split the probes across workers
    router: str = ""  # the router's kind and version ("smg 1.13.0"); "" for a worker
    # route -> {"isolated": bool (None: not reported), "probes": [Probe, Probe, Probe]}
    routes: dict = field(default_factory=dict)
    not_isolatable: bool = False  # a gRPC worker: no salt or API key reaches it, so it was not probed

    def as_dict(self) -> dict:
        return asdict(self)


def _prompt(words: int, rng: random.Random) -> str:
    return f"isolation check {secrets.token_hex(8)}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def _body(route: str, text: str, salt: str, model: str, max_new_tokens: int) -> dict:
    if route == "/generate":
        body: dict = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    elif route == "/v1/completions":
        body = {"model": model, "prompt": text, "max_tokens": max_new_tokens, "temperature": 0}
    else:
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_new_tokens,
                "temperature": 0}  # fmt: skip
    return {**body, "cache_salt": salt}


def _probe(client: httpx.Client, url: str, route: str, name: str, body: dict) -> tuple[Probe, int]:
    try:
        resp = client.post(route, json=body)
    except httpx.HTTPError as exc:
        raise IsolationCheckError(f"{url} unreachable: {exc}") from None
    if resp.status_code != 200:
        raise IsolationCheckError(
            f"{url}{route} answered {resp.status_code}: {resp.text[:300]}", resp.status_code
        )
    out = resp.json()
    if route == "/generate":
        meta = out["meta_info"]
        cached = {t: int(meta["cached_tokens_details"].get(t, 0)) for t in ("device", "host", "storage")}
        return Probe(name, cached, float(meta.get("ttft", 0.0)), list(out["output_ids"])), meta[
            "prompt_tokens"
        ]
    choice = out["choices"][0]
    text = choice["text"] if route == "/v1/completions" else choice["message"].get("content")
    usage = out.get("usage") or {}
    details = usage.get("prompt_tokens_details")  # absent unless the worker runs --enable-cache-report
    cached = {} if details is None else {"total": int(details.get("cached_tokens") or 0)}
    return Probe(name, cached, 0.0, [text]), int(usage.get("prompt_tokens", 0))


def check_isolation(
    url: str, api_key: str | None = None, words: int = 400, max_new_tokens: int = 4, timeout: float = 120.0
) -> IsolationReport:
    """Run the check against the worker or router at ``url`` (its ``--api-key`` or a tenant key as bearer, if
    given). ``words``: prompt length in words (about as many tokens; it must span several pages to be
    cached). Raises ``IsolationCheckError`` when a request fails."""
    rng = random.Random()
    salts = {"A": "isolation-check-" + secrets.token_hex(16), "B": "isolation-check-" + secrets.token_hex(16)}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout) as client:
        identity = _router_identity(client)
        if identity is None and _serves_grpc(client):
            problem = grpc_isolation_problem([url.rstrip("/")])
            return IsolationReport(False, 0, [], [problem], not_isolatable=True)
        router_workers = None if identity is None else _router_workers(client)
        routes = SALT_ROUTES if identity is not None else ("/generate",)
        model = _model(client, url) if len(routes) > 1 else ""
        probed: dict = {}
        prompt_tokens = 0
        for route in routes:
            text = _prompt(words, rng)
            probes = []
            for name in ("A", "B", "A"):
                probe, tokens = _probe(
                    client, url, route, name, _body(route, text, salts[name], model, max_new_tokens)
                )
                probes.append(probe)
                prompt_tokens = tokens if route == "/generate" else prompt_tokens
            probed[route] = probes
    return _judge(prompt_tokens, probed, router_workers, identity)


def _router_identity(client: httpx.Client):
    """The router at the URL (engine/fleet/identity.py), or None: a worker (it does not serve /get_loads)."""
    try:
        resp = client.get("/get_loads")
        return identify_router(resp.json()) if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _serves_grpc(client: httpx.Client) -> bool:
    """Whether the worker's ``/server_info`` says it serves gRPC (``grpc_mode``; KVFleet's and upstream's
    launch args). A worker that does not answer it is probed as usual (the probes then say what fails)."""
    try:
        resp = client.get("/server_info")
        info = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return False
    return isinstance(info, dict) and info.get("grpc_mode") is True


def _router_workers(client: httpx.Client) -> int | None:
    """How many workers the router lists at ``GET /workers`` (smg's draining ones left out)."""
    try:
        resp = client.get("/workers")
        listed = resp.json().get("workers") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if not isinstance(listed, list):
        return None
    return sum(1 for w in listed if not (isinstance(w, dict) and w.get("status") == "draining"))


def _model(client: httpx.Client, url: str) -> str:
    try:
        resp = client.get("/v1/models")
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        raise IsolationCheckError(f"{url}/v1/models names no model (the OpenAI routes need one)") from None


def _judge(prompt_tokens: int, probed: dict, router_workers: int | None, identity) -> IsolationReport:
    problems, routes = [], {}
    for route, (cold, other, again) in probed.items():
        where = "" if len(probed) == 1 else f"{route}: "
        if not (cold.cached and other.cached and again.cached):
            problems.append(f"{where}the worker reports no cached tokens on this route (it runs without "
                            "--enable-cache-report), so the route cannot be checked")  # fmt: skip
            routes[route] = {"isolated": None, "probes": [cold, other, again]}
            continue
        isolated = not sum(other.cached.values())
        if not isolated:
            problem = (
                f"{where}salt B reused {other.cached} cached tokens of salt A's prompt: salts share cache"
            )
            if identity is not None:
                carried = identity.salt_routes.get(route)
                why = (
                    "which drops cache_salt there"
                    if carried is False
                    else "which passes cache_salt on: the worker shares it"
                    if carried
                    else "not verified to pass cache_salt on"
                )
                problem += f" (through {identity.label}, {why}; to isolate tenants, {TENANT_KEYS_ADVICE})"
            problems.append(problem)
        if not sum(again.cached.values()):
            problems.append(f"{where}salt A's second request reused nothing (is the prefix cache disabled, "
                            "or the prompt shorter than a page?)")  # fmt: skip
        if not cold.output_ids == other.output_ids == again.output_ids:
            problems.append(f"{where}the three answers differ (greedy decoding of one prompt must agree)")
        routes[route] = {"isolated": isolated, "probes": [cold, other, again]}
    inconclusive = not problems and router_workers is not None and router_workers != 1
    if inconclusive:
        problems.append(
            f"inconclusive: the router lists {router_workers} workers, so salt B may have run on another "
            "worker than salt A; check each worker's URL, or a router with one worker"
        )
    return IsolationReport(
        ok=not problems,
        prompt_tokens=prompt_tokens,
        probes=probed["/generate"],
        problems=problems,
        router_workers=router_workers,
        inconclusive=inconclusive,
        router="" if identity is None else identity.label,
        routes=routes,
    )


def _total(probe: Probe) -> str:
    return str(sum(probe.cached.values())) if probe.cached else "-"


def format_report(report: IsolationReport) -> str:
    if report.not_isolatable:
        return "\n".join(["isolation: NOT ISOLATABLE", *(f"  - {p}" for p in report.problems)])
    lines = [f"prompt: {report.prompt_tokens} tokens"]
    for label, p in zip(("salt A (cold)", "salt B", "salt A (again)"), report.probes, strict=True):
        tiers = " ".join(f"{t}={n}" for t, n in p.cached.items())
        lines.append(f"{label:15} ttft {p.ttft_s * 1000:8.1f} ms  cached {tiers}")
    cold, other, again = report.probes
    if again.ttft_s > 0:
        lines.append(f"salt B / salt A (again) TTFT: {other.ttft_s / again.ttft_s:.2f}x")
    if report.router:
        lines.append(f"via {report.router} with {report.router_workers} worker(s) listed")
        for route, result in report.routes.items():
            _, b, a = result["probes"]
            verdict = {True: "salts apart", False: "SALTS SHARE CACHE", None: "NOT REPORTED"}[
                result["isolated"]
            ]
            lines.append(
                f"  {route:22} salt B cached {_total(b):>5}  salt A (again) cached {_total(a):>5}  {verdict}"
            )
    verdict = "ok" if report.ok else "INCONCLUSIVE" if report.inconclusive else "FAILED"
    lines.append(f"isolation: {verdict}")
    lines += [f"  - {p}" for p in report.problems]
    return "\n".join(lines)
