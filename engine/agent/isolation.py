"""An isolation self-test against a live worker (``kvfleet-agent check-isolation URL``).

One prompt no one has sent before (a random nonce first), three ``/generate`` requests, one at a time:
salt A (cold), salt B (must reuse nothing: 0 cached tokens in every tier), salt A again (must reuse the
prompt's cached pages). Both salts are fresh random values, so the check never reads or pollutes a real
tenant's cache. It passes when B got no cached token, A's second request got some, and all three answered the
same greedy tokens. TTFTs are the worker's ``meta_info.ttft`` (seconds from arrival to first token).
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
        for name in ("A", "B", "A"):
            body = {
                "text": text,
                "cache_salt": salts[name],
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
    cold, other, again = probes
    problems = []
    if sum(other.cached.values()):
        problems.append(f"salt B reused {other.cached} cached tokens of salt A's prompt: salts share cache")
    if not sum(again.cached.values()):
        problems.append("salt A's second request reused nothing (is the prefix cache disabled, or the "
                        "prompt shorter than a page?)")  # fmt: skip
    if not cold.output_ids == other.output_ids == again.output_ids:
        problems.append("the three answers differ (greedy decoding of one prompt must agree)")
    return IsolationReport(not problems, prompt_tokens, probes, problems)


def format_report(report: IsolationReport) -> str:
    lines = [f"prompt: {report.prompt_tokens} tokens"]
    for label, p in zip(("salt A (cold)", "salt B", "salt A (again)"), report.probes, strict=True):
        tiers = " ".join(f"{t}={n}" for t, n in p.cached.items())
        lines.append(f"{label:15} ttft {p.ttft_s * 1000:8.1f} ms  cached {tiers}")
    cold, other, again = report.probes
    if again.ttft_s > 0:
        lines.append(f"salt B / salt A (again) TTFT: {other.ttft_s / again.ttft_s:.2f}x")
    lines.append("isolation: ok" if report.ok else "isolation: FAILED")
    lines += [f"  - {p}" for p in report.problems]
    return "\n".join(lines)
