"""Multi-turn chat traffic for a fleet (through the router or straight to a worker).

Workload: ``--conversations`` conversations over ``--documents`` shared documents (``--doc-words`` words
each, each document always behind the same one of ``--system-prompts`` system prompts), so conversations
share long prefixes. ``--concurrency`` clients loop over the conversations round-robin; each request sends
the whole history plus a new question (``/generate`` with ``text``, greedy, ``--max-new-tokens`` tokens,
``ignore_eos``) and appends the answer. After ``--turns`` turns a conversation starts over on another
document. Coming back to a document or a conversation after the others pushed it out of L1 (and L2) is what
produces host (and storage) hits. ``--trace`` instead replays a Mooncake trace scaled down by
``--trace-scale`` (token-id prompts; see ``engine.bench.multiturn``).

Every request is appended to ``--record`` (JSON lines: prompt, output text and ids, cached tokens per tier,
error), which ``--verify URL`` replays against one worker to check each answer is the same greedy text.
Stops after ``--duration`` seconds or ``--max-requests`` requests, or on SIGINT/SIGTERM, and prints a
summary (requests, errors, cached prompt tokens per tier).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time

import httpx

_WORD_TEXT = """
cache page token prefix layer memory host device storage request worker router fleet model batch prefill
decode
latency throughput kernel tensor shard replica policy eviction backup prefetch queue schedule attention block
budget window session history answer question document summary section table figure result method system
design network server client config metric counter gauge trace river mountain forest ocean garden village
market harbor bridge castle library museum station morning evening winter summer autumn spring golden silver
copper marble crystal velvet
"""
WORDS = tuple(_WORD_TEXT.split())
QUESTIONS = (
    "What is the main point of the document?",
    "Which part of the document matters most for the design?",
    "Summarize the last answer in one sentence.",
    "What would you change first, and why?",
    "List two risks mentioned so far.",
    "How does this relate to the system prompt?",
    "Give one concrete example from the document.",
    "What should the operator check next?",
)


def _prose(rng: random.Random, n_words: int) -> str:
    sentences, words = [], []
    for i in range(n_words):
        words.append(rng.choice(WORDS))
        if len(words) >= rng.randint(8, 14) or i == n_words - 1:
            sentences.append(" ".join(words).capitalize() + ".")
            words = []
    return " ".join(sentences)


class Conversation:
    """One chat over a document: ``turns`` questions and answers, then a fresh chat on the next document.

    Document ``d`` always comes with system prompt ``d % len(systems)``, so every chat over it shares the
    same prefix; conversation ``c`` reads documents ``c, c + stride, c + 2 * stride, ...`` (mod the count).
    """

    def __init__(self, cid: int, systems: list[str], docs: list[str], stride: int, turns: int, seed: int):
        self.cid, self.systems, self.docs, self.stride, self.turns = cid, systems, docs, stride, turns
        self.rng = random.Random(seed)
        self.doc_index = cid - stride
        self.reset()

    def reset(self) -> None:
        self.doc_index = (self.doc_index + self.stride) % len(self.docs)
        system = self.systems[self.doc_index % len(self.systems)]
        self.history = f"System: {system}\n\nDocument:\n{self.docs[self.doc_index]}\n"
        self.turn = 0

    def next_prompt(self) -> str:
        question = self.rng.choice(QUESTIONS)
        return f"{self.history}\nUser: {question} (conversation {self.cid}, turn {self.turn})\nAssistant:"

    def answered(self, prompt: str, answer: str) -> None:
        self.history, self.turn = prompt + answer + "\n", self.turn + 1
        if self.turn >= self.turns:
            self.reset()


def build_conversations(a: argparse.Namespace) -> list[Conversation]:
    rng = random.Random(a.seed)
    systems = [
        f"You are assistant {i} of the KVFleet demo. " + _prose(rng, a.system_words)
        for i in range(a.system_prompts)
    ]
    docs = [_prose(rng, a.doc_words) for _ in range(a.documents)]
    n = a.conversations
    return [Conversation(c, systems, docs, n, a.turns, a.seed * 1000 + c) for c in range(n)]


UNAVAILABLE_RETRY_S = 60.0  # how long a request waits out "no available workers" (every worker drained)


async def generate(client: httpx.AsyncClient, body: dict) -> dict:
    """POST /generate; returns ``{text, output_ids, cached, prompt_tokens, retries}`` or ``{error}``.

    A router answering 503 ``no_available_workers`` (every worker drained for a moment) is retried every
    0.5 s for up to ``UNAVAILABLE_RETRY_S`` seconds, as a client behind a load balancer does; ``retries``
    counts those attempts. Any other failure is returned as ``error``.
    """
    retries, deadline = 0, time.monotonic() + UNAVAILABLE_RETRY_S
    while True:
        try:
            resp = await client.post("/generate", json=body)
        except httpx.HTTPError as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "retries": retries}
        if resp.status_code == 503 and "no_available_workers" in resp.text and time.monotonic() < deadline:
            retries += 1
            await asyncio.sleep(0.5)
            continue
        break
    if resp.status_code != 200:
        return {"error": f"HTTP {resp.status_code}: {resp.text[:300]}", "retries": retries}
    out = resp.json()
    meta = out.get("meta_info", {})
    if (meta.get("finish_reason") or {}).get("type") == "abort":
        return {"error": f"aborted: {meta['finish_reason'].get('message')}", "retries": retries}
    return {
        "text": out.get("text", ""),
        "output_ids": out.get("output_ids"),
        "cached": meta.get("cached_tokens_details") or {},
        "prompt_tokens": meta.get("prompt_tokens"),
        "retries": retries,
    }


def sampling(a: argparse.Namespace, max_new_tokens: int | None = None) -> dict:
    return {"max_new_tokens": max_new_tokens or a.max_new_tokens, "temperature": 0, "ignore_eos": True}


class Run:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.stop = asyncio.Event()
        self.count = self.errors = 0
        self.cached = {"device": 0, "host": 0, "storage": 0}
        self.record = open(a.record, "a") if a.record else None  # noqa: SIM115
        self.started = self.progressed = time.perf_counter()

    def log(self, item: dict) -> None:
        self.count += 1
        if "error" in item:
            self.errors += 1
            print(f"traffic: request {self.count} failed: {item['error']}", file=sys.stderr, flush=True)
        for tier in self.cached:
            self.cached[tier] += int(item.get("cached", {}).get(tier, 0))
        if self.record:
            self.record.write(json.dumps(item) + "\n")
            self.record.flush()
        now = time.perf_counter()
        if self.a.progress_s and now - self.progressed >= self.a.progress_s:  # the totals so far
            self.progressed = now
            print(self.summary(now - self.started), flush=True)
        if self.a.max_requests and self.count >= self.a.max_requests:
            self.stop.set()

    async def chat(self, client: httpx.AsyncClient, convs: list[Conversation]) -> None:
        """One client: takes turns in its own conversations, round-robin."""
        i = 0
        while not self.stop.is_set():
            conv = convs[i % len(convs)]
            i += 1
            prompt = conv.next_prompt()
            t = time.time()
            res = await generate(client, {"text": prompt, "sampling_params": sampling(self.a)})
            self.log({"t": t, "latency_s": round(time.time() - t, 3), "conversation": conv.cid,
                      "turn": conv.turn, "prompt": prompt, **res})  # fmt: skip
            if "error" in res:
                await asyncio.sleep(1.0)
            else:
                conv.answered(prompt, res["text"])

    async def trace(self, client: httpx.AsyncClient) -> None:
        from engine.bench.multiturn import trace_requests

        vocab = (await client.get("/get_model_info")).json().get("vocab_size", 49152)
        reqs = trace_requests(self.a.trace, self.a.trace_scale, self.a.max_requests or 10**9, vocab)
        sem = asyncio.Semaphore(self.a.concurrency)
        start = time.perf_counter()

        async def one(at: float, ids: list[int], n_out: int) -> None:
            await asyncio.sleep(max(0.0, start + at / self.a.trace_speedup - time.perf_counter()))
            async with sem:
                if self.stop.is_set():
                    return
                t = time.time()
                body = {
                    "input_ids": ids,
                    "sampling_params": sampling(self.a, min(n_out, self.a.max_new_tokens)),
                }
                res = await generate(client, body)
                self.log({"t": t, "latency_s": round(time.time() - t, 3), "input_ids": ids,
                          "max_new_tokens": body["sampling_params"]["max_new_tokens"], **res})  # fmt: skip

        tasks = [asyncio.create_task(one(*r)) for r in reqs]
        stopper = asyncio.create_task(self.stop.wait())
        await asyncio.wait([asyncio.gather(*tasks), stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        stopper.cancel()

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop.set)
        if self.a.duration:
            loop.call_later(self.a.duration, self.stop.set)
        async with httpx.AsyncClient(base_url=self.a.url, timeout=self.a.request_timeout) as client:
            if self.a.trace:
                await self.trace(client)
                return
            convs = build_conversations(self.a)
            n = min(self.a.concurrency, len(convs))
            await asyncio.gather(*(self.chat(client, convs[k::n]) for k in range(n)))

    def summary(self, wall: float) -> str:
        c = self.cached
        return (f"traffic: {self.count} requests in {wall:.0f}s, {self.errors} errors; cached prompt tokens "
                f"device {c['device']}, host {c['host']}, storage {c['storage']}")  # fmt: skip


def verify(record: str, url: str, timeout: float = 300.0) -> int:
    """Replay every successful recorded request against ``url``; returns how many answers differ."""
    bad = 0
    with httpx.Client(base_url=url, timeout=timeout) as client, open(record) as f:
        for line in f:
            item = json.loads(line)
            if "error" in item:
                continue
            sp = {"max_new_tokens": item.get("max_new_tokens") or len(item["output_ids"]), "temperature": 0,
                  "ignore_eos": True}  # fmt: skip
            key = "prompt" if "prompt" in item else "input_ids"
            body = {"text" if key == "prompt" else key: item[key], "sampling_params": sp}
            got = client.post("/generate", json=body).json()
            if got["output_ids"] != item["output_ids"]:
                bad += 1
                where = f"{item.get('conversation')}/{item.get('turn')}"
                print(
                    f"verify: mismatch in conversation/turn {where}: {got.get('text')!r} != {item['text']!r}"
                )
    return bad


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.bench.traffic", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="router or worker base URL")
    p.add_argument("--duration", type=float, default=0, help="seconds to run (0: until stopped)")
    p.add_argument("--max-requests", type=int, default=0, help="stop after this many requests (0: no limit)")
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4, help="turns before a conversation starts over")
    p.add_argument("--system-prompts", type=int, default=2)
    p.add_argument("--system-words", type=int, default=40)
    p.add_argument("--documents", type=int, default=4)
    p.add_argument("--doc-words", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--record", help="append every request and answer to this JSON-lines file")
    p.add_argument(
        "--progress-s",
        type=float,
        default=30.0,
        help="print the totals so far every this many seconds (0: only at the end)",
    )
    p.add_argument("--trace", help="Mooncake trace .jsonl to replay instead of conversations")
    p.add_argument("--trace-scale", type=int, default=16, help="divide trace lengths and blocks by k")
    p.add_argument("--trace-speedup", type=float, default=1.0, help="divide trace timestamps by this")
    p.add_argument("--verify", metavar="WORKER_URL", help="replay --record against this worker and compare")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.verify:
        if not a.record:
            print("--verify needs --record", file=sys.stderr)
            return 2
        bad = verify(a.record, a.verify)
        print(f"verify: {bad} mismatches")
        return 1 if bad else 0
    run = Run(a)
    t = time.perf_counter()
    asyncio.run(run.main())
    print(run.summary(time.perf_counter() - t), flush=True)
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
