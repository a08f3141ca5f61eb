"""The rebalance canary: a fixed set of greedy prompts of different lengths, recorded through the router when
a rebalance is created and checked, each for the same text, through every step's new pairing.

The set: a short prompt, a sentence, and a long one of more words than two KV pages hold tokens (a word is at
least one token), so its KV crosses pages, ending in a partial one, and moves from prefill to decode as
several page runs. Stored on the rebalance as ``{"page_size", "prompts": [{"text", "max_new_tokens",
"prompt_tokens", "expected_text"}]}``.
"""

from __future__ import annotations

import math

from django.conf import settings

from controlplane.core.exceptions import ServiceUnavailable
from controlplane.inventory.models import Router
from controlplane.workerclient import RouterClient, WorkerClient, WorkerError, pd_pair_generate

SHORT = "The capital of France is"
SENTENCE = "In one sentence, the harbour master explains why the lights at the mouth of the river are green:"
LOG_LINE = (
    "the keeper wrote down the wind, the height of the tide, the ships that passed and the state of the lamp."
)


def prompts(page_size: int) -> list[dict]:
    """[{text, max_new_tokens}]: the short prompt, the sentence, and the log of ``2 * page_size + 1`` words
    or more (``page_size``: the largest KV page, in tokens, of the router's workers)."""
    lines = math.ceil((2 * max(1, page_size) + 1) / len(LOG_LINE.split()))
    log = " ".join(f"Day {i + 1}: {LOG_LINE}" for i in range(lines))
    n = settings.REBALANCE_CANARY_MAX_NEW_TOKENS
    return [
        {"text": SHORT, "max_new_tokens": n},
        {"text": SENTENCE, "max_new_tokens": n},
        {"text": f"The lighthouse log. {log} Summary of the log:", "max_new_tokens": n},
    ]


def _body(prompt: dict) -> dict:
    return {
        "text": prompt["text"],
        "sampling_params": {"max_new_tokens": prompt["max_new_tokens"], "temperature": 0},
    }


def record(router: Router, page_size: int) -> dict:
    """Each prompt's greedy answer through the router (with its workers' API key when they have one: the
    router passes the client's key on to the pair it picks, so a PD fleet behind one router shares one).
    Raises ServiceUnavailable (503 ``canary_failed``) naming the prompt when the router does not answer."""
    api_key = next((w.api_key for w in router.workers.exclude(api_key_encrypted="")), "")
    client, recorded = RouterClient(router.url), []
    for i, prompt in enumerate(prompts(page_size)):
        try:
            answer = client.generate(
                _body(prompt), timeout=settings.REBALANCE_CANARY_TIMEOUT_S, api_key=api_key
            )
        except WorkerError as exc:
            raise ServiceUnavailable(
                f"canary {i + 1} through router {router.name} failed: {exc.message}", code="canary_failed"
            ) from exc
        tokens = (answer.get("meta_info") or {}).get("prompt_tokens")
        recorded.append({**prompt, "prompt_tokens": tokens, "expected_text": answer.get("text")})
    return {"page_size": page_size, "prompts": recorded}


def check(canary: dict, prefill: WorkerClient, decode: WorkerClient, bootstrap_port: int | None) -> str:
    """'' when every recorded prompt, sent through this prefill/decode pair as the router sends it, gives
    its recorded text; else what the first one that did not answered (or its error). ``bootstrap_port``:
    the prefill's (None when the router does not list it: then that is the answer)."""
    pair = f"{prefill.base_url} -> {decode.base_url}"
    if bootstrap_port is None:
        return f"no bootstrap port known for the prefill of {pair}"
    items = canary["prompts"]
    for i, prompt in enumerate(items):
        what = f"canary {i + 1} of {len(items)} ({prompt.get('prompt_tokens')} prompt tokens) through {pair}"
        try:
            text = pd_pair_generate(prefill, decode, bootstrap_port, _body(prompt)).get("text")
        except WorkerError as exc:
            return f"{what} failed: {exc.message}"
        if text != prompt["expected_text"]:
            return f"{what} answered {text!r}, expected {prompt['expected_text']!r}"
    return ""
