"""An isolation self-test against a live worker (``kvfleet-agent check-isolation URL``).

One prompt no one has sent before (a random nonce first), three ``/generate`` requests, one at a time:
salt A (cold), salt B (must reuse nothing: 0 cached tokens in every tier), salt A again (must reuse the
prompt's cached pages). Both salts are fresh random values, so the check never reads or pollutes a real
tenant's cache. It passes when B got no cached token, A's second request got some, and all three answered the
same greedy tokens. TTFTs are the worker's ``meta_info.ttft`` (seconds from arrival to first token).

Each salt goes as both ``cache_salt`` and ``extra_key`` (the worker takes either; they are equal), because
sglang-router rebuilds a /generate body from its own request type and drops ``cache_salt`` but forwards
``extra_key``. A URL that answers ``GET /workers`` with a worker list is taken for a router: with exactly
one worker behind it the result stands; with more (or a PD router, which lists none) the three requests may
land on different workers, so "salt B reused nothing" proves nothing and the check is inconclusive
(``ok`` False, ``inconclusive`` True) rather than passed. Reuse by salt B is a failure wherever it lands.
"""

from __future__ import annotations

import random
import secrets
from dataclasses import asdict, dataclass

import httpx

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
    """The worker could not be checked (unreachable, a non-200 answer); the message says which, ``status``
    is the worker's HTTP status (None: it did not answer)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class Probe:
    salt: str  # "A" or "B", never the salt itself
    cached: dict  # cached tokens per tier: device, host, storage
    ttft_s: float
    output_ids: list


@dataclass
class IsolationReport:
    ok: bool
    prompt_tokens: int
    probes: list  # of Probe: A cold, B, A again
    problems: list  # sentences, empty when ok
    router_workers: int | None = None  # URL is a router: workers it lists (PD mode: 0); None: a worker
    inconclusive: bool = False  # nothing reused, but the router may have split the probes across workers

    def as_dict(self) -> dict:
        return asdict(self)


def _prompt(words: int, rng: random.Random) -> str:
    return f"isolation check {secrets.token_hex(8)}: " + " ".join(rng.choice(WORDS) for _ in range(words))


def check_isolation(
    url: str, api_key: str | None = None, words: int = 400, max_new_tokens: int = 4, timeout: float = 120.0
) -> IsolationReport:
    """Run the check against the worker at ``url`` (its ``--api-key`` or a tenant key as bearer, if given).
    ``words``: prompt length in words (about as many tokens; it must span several pages to be cached).
    Raises ``IsolationCheckError`` when a request fails."""
    text = _prompt(words, random.Random())
    salts = {"A": "isolation-check-" + secrets.token_hex(16), "B": "isolation-check-" + secrets.token_hex(16)}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    probes: list[Probe] = []
    prompt_tokens = 0
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout) as client:
        router_workers = _router_workers(client)
        for name in ("A", "B", "A"):
            body = {
                "text": text,
                "cache_salt": salts[name],
                "extra_key": salts[name],
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            }
            try:
                resp = client.post("/generate", json=body)
            except httpx.HTTPError as exc:
                raise IsolationCheckError(f"{url} unreachable: {exc}") from None
            if resp.status_code != 200:
                raise IsolationCheckError(
                    f"{url}/generate answered {resp.status_code}: {resp.text[:300]}", resp.status_code
                )
            out = resp.json()
            meta = out["meta_info"]
            prompt_tokens = meta["prompt_tokens"]
            cached = {t: int(meta["cached_tokens_details"].get(t, 0)) for t in ("device", "host", "storage")}
            probes.append(Probe(name, cached, float(meta.get("ttft", 0.0)), list(out["output_ids"])))
    return _judge(prompt_tokens, probes, router_workers)


def _router_workers(client: httpx.Client) -> int | None:
    """How many workers the URL lists at ``GET /workers`` if it is an sglang-router; None for a worker."""
    try:
        resp = client.get("/workers")
        listed = resp.json().get("workers") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return len(listed) if isinstance(listed, list) else None


def _judge(prompt_tokens: int, probes: list[Probe], router_workers: int | None) -> IsolationReport:
    cold, other, again = probes
    problems = []
    if sum(other.cached.values()):
        problem = f"salt B reused {other.cached} cached tokens of salt A's prompt: salts share cache"
        if router_workers is not None:
            problem += (
                " (through sglang-router, which drops /generate's cache_salt and passes extra_key on: "
                "workers older than this check ignore extra_key; give each tenant its API key with "
                "--tenant-keys-file, which the router passes on as Authorization)"
            )
        problems.append(problem)
    if not sum(again.cached.values()):
        problems.append("salt A's second request reused nothing (is the prefix cache disabled, or the "
                        "prompt shorter than a page?)")  # fmt: skip
    if not cold.output_ids == other.output_ids == again.output_ids:
        problems.append("the three answers differ (greedy decoding of one prompt must agree)")
    inconclusive = not problems and router_workers is not None and router_workers != 1
    if inconclusive:
        problems.append(
            f"inconclusive: the router lists {router_workers} workers (PD mode lists none), so salt B may "
            "have run on another worker than salt A; check each worker's URL, or a router with one worker"
        )
    return IsolationReport(not problems, prompt_tokens, probes, problems, router_workers, inconclusive)


def format_report(report: IsolationReport) -> str:
    lines = [f"prompt: {report.prompt_tokens} tokens"]
    for label, p in zip(("salt A (cold)", "salt B", "salt A (again)"), report.probes, strict=True):
        tiers = " ".join(f"{t}={n}" for t, n in p.cached.items())
        lines.append(f"{label:15} ttft {p.ttft_s * 1000:8.1f} ms  cached {tiers}")
    cold, other, again = report.probes
    if again.ttft_s > 0:
        lines.append(f"salt B / salt A (again) TTFT: {other.ttft_s / again.ttft_s:.2f}x")
    if report.router_workers is not None:
        lines.append(f"via sglang-router with {report.router_workers} worker(s) listed")
    verdict = "ok" if report.ok else "INCONCLUSIVE" if report.inconclusive else "FAILED"
    lines.append(f"isolation: {verdict}")
    lines += [f"  - {p}" for p in report.problems]
    return "\n".join(lines)
