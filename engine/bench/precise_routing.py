"""smg's precise (KV-event) routing against its approximate tree, on the same replayed traffic.

``python -m engine.bench.precise_routing --model-path DIR``: two ``--grpc-mode`` workers behind a real smg
(``--policy cache_aware``, ``--block-size`` = the page size), run twice on fresh workers with the same
traffic: ``approximate`` (workers with ``--disable-kv-events``: smg routes by its tree of what it sent) and
``precise`` (workers publish KV events: smg routes by the pages each worker holds). The only difference
between the runs is the event stream.

Traffic (seeded, identical in both runs): ``--sessions`` conversations, each opening with one of
``--system-prompts`` shared prefixes of ``--system-tokens`` tokens, ``--turns`` turns of ``--user-tokens``
new tokens and ``--output-tokens`` greedy answer tokens kept in the history; turns run in lock step, at
most ``--concurrency`` requests in flight, sessions in a fresh shuffled order each turn. L1 per worker is
``--max-total-tokens`` (small, so workers evict and the router's tree goes stale).

Reports per run: cache hit rate (cached ÷ prompt tokens as the worker reports them, all turns and turns
after the first), TTFT mean and p90 (streamed ``/generate`` through smg: time to the first token frame),
and the ratios precise ÷ approximate. ``--router-arg`` passes smg flags to both runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess, worker_args


def build_traffic(a: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """System prompts and, per session, its user turns (token ids in [3, ``--vocab``))."""
    rng = random.Random(a.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, a.vocab) for _ in range(n)]

    systems = [tokens(a.system_tokens) for _ in range(a.system_prompts)]
    turns = [[tokens(a.user_tokens) for _ in range(a.turns)] for _ in range(a.sessions)]
    return systems, turns


async def _request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], a) -> dict:
    body = {
        "model": model,
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": a.output_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    start = time.perf_counter()
    ttft, last, ids = None, None, []
    async with client.stream("POST", f"{url}/generate", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/generate answered {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            frame = json.loads(line[5:])
            if ttft is None and frame.get("output_ids"):
                ttft = time.perf_counter() - start
            ids += frame.get("output_ids", [])  # smg streams each frame's new ids
            last = frame
    assert last is not None and ttft is not None, "the stream carried no token"
    meta = last["meta_info"]
    return {"ttft": ttft, "ids": ids, "prompt": meta["prompt_tokens"], "cached": meta["cached_tokens"]}


async def _replay(url: str, model: str, a) -> list[dict]:
    systems, turns = build_traffic(a)
    history = [list(systems[s % len(systems)]) for s in range(a.sessions)]
    rng = random.Random(a.seed + 1)
    sem = asyncio.Semaphore(a.concurrency)
    out: list[dict] = []
    async with httpx.AsyncClient(timeout=600) as client:
        for t in range(a.turns):
            order = list(range(a.sessions))
            rng.shuffle(order)

            async def one(s: int, t: int = t) -> None:
                async with sem:
                    prompt = history[s] + turns[s][t]
                    res = await _request(client, url, model, prompt, a)
                # the answer joins the history (ids past --vocab dropped: a test model may emit ids past its
                # tokenizer's vocabulary, which the worker refuses as input)
                history[s] = prompt + [i for i in res["ids"] if i < a.vocab]
                out.append({**res, "turn": t})

            await asyncio.gather(*(one(s) for s in order))
    return out


def run(a: argparse.Namespace, precise: bool) -> dict:
    flags = ["--model-path", a.model_path, "--page-size", str(a.page_size), "--max-total-tokens",
             str(a.max_total_tokens), "--grpc-mode"]  # fmt: skip
    if not precise:
        flags.append("--disable-kv-events")
    extra = ("--model-path", a.model_path, "--block-size", str(a.page_size), *a.router_arg)
    with (
        ServerProcess(flags) as w0,
        ServerProcess(flags) as w1,
        RouterProcess(worker_args([w0.url, w1.url]), extra=extra, min_workers=2) as router,
    ):
        results = asyncio.run(_replay(router.url, a.model_path, a))
        metrics = httpx.get(router.metrics_url, timeout=5).text
    subscribed = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("smg_kv_event_subscriptions_total")
    )
    warm = [r for r in results if r["turn"] > 0]
    ttfts = sorted(r["ttft"] for r in results)
    return {
        "hit_rate": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
        "hit_rate_warm": sum(r["cached"] for r in warm) / max(1, sum(r["prompt"] for r in warm)),
        "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
        "ttft_p90_ms": 1000 * ttfts[int(0.9 * (len(ttfts) - 1))],
        "requests": len(results),
        "kv_subscriptions": subscribed,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m engine.bench.precise_routing", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--vocab", type=int, default=300, help="token ids are drawn from [3, VOCAB)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=2048, help="L1 tokens per worker")
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=128)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="an extra smg flag or value for both runs (repeat), e.g. "
        "--router-arg=--selection-accounting-ttl-ms --router-arg=200",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    runs = {"approximate": run(a, precise=False), "precise": run(a, precise=True)}
    print(
        "| run | hit rate | hit rate (turns > 0) | TTFT mean ms | TTFT p90 ms | requests | KV subscriptions |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['hit_rate']:.3f} | {r['hit_rate_warm']:.3f} | {r['ttft_mean_ms']:.1f} | "
              f"{r['ttft_p90_ms']:.1f} | {r['requests']} | {r['kv_subscriptions']:.0f} |")  # fmt: skip
    base, new = runs["approximate"], runs["precise"]
    print(
        f"precise / approximate: hit rate x{new['hit_rate'] / max(base['hit_rate'], 1e-9):.3f}, "
        f"TTFT mean x{new['ttft_mean_ms'] / base['ttft_mean_ms']:.3f}, "
        f"TTFT p90 x{new['ttft_p90_ms'] / base['ttft_p90_ms']:.3f}"
    )


if __name__ == "__main__":
    main()
