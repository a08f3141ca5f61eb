"""Same-run A/B of the HTTP request path (body to scheduler and back) between a git revision and this tree.

``python -m engine.bench.request_ab [--base main] [--reps 4] [--requests 48] [--concurrency 4]
[--max-tokens 4] [-- LAUNCH FLAGS]``

``--base`` is checked out into a temporary detached git worktree (removed at the end); one worker of each
tree runs at the same time (``python -P -m engine.launch_server`` with the tree on ``PYTHONPATH``, so each
imports its own code; launch flags after ``--``, default ``--model-path smollm2``). Each repetition sends
both workers, one after the other (the order alternates), the same rounds: ``--requests`` requests with
``--concurrency`` in flight on each of ``/generate``, ``/v1/completions`` (streamed) and
``/v1/chat/completions``, each asking for ``--max-tokens`` tokens (``ignore_eos``) of a distinct short
prompt, after a ``/flush_cache`` so both start cold. Printed per route: the wall ms per request of both trees
(median over repetitions) and the ratio this tree / base within each repetition, median (min-max), with the
load average after each repetition. Below 1.00 means this tree is faster. Small models make the request
path a larger share of a request, so its cost shows more.

Raises ``RuntimeError`` when a worker does not start and ``httpx.HTTPStatusError`` when a request fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.bench.launcher import ServerProcess

REPO = Path(__file__).resolve().parents[2]
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def _body(route: str, i: int, max_tokens: int) -> dict:
    """Request ``i`` of ``route``: a distinct short prompt, ``max_tokens`` tokens whatever the model says."""
    text = f"Request {i}: name three colours of the sea"
    if route == "/generate":
        return {"text": text, "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True}}
    if route == "/v1/completions":
        return {"prompt": text, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    messages = [{"role": "user", "content": text}]
    return {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True}


async def _round(url: str, route: str, requests: int, concurrency: int, max_tokens: int) -> float:
    """Wall ms per request of ``requests`` requests to ``route``, ``concurrency`` at a time."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        (await client.post("/flush_cache")).raise_for_status()
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with gate:
                body = _body(route, i, max_tokens)
                if body.get("stream"):
                    async with client.stream("POST", route, json=body) as resp:
                        resp.raise_for_status()
                        async for _ in resp.aiter_lines():
                            pass
                else:
                    (await client.post(route, json=body)).raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(requests)))
        return (time.perf_counter() - start) * 1000 / requests


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main", help="git revision to compare against")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48, help="requests per route and round")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    args = ap.parse_args(argv[:split])
    flags = argv[split + 1 :] or ["--model-path", "smollm2"]
    with tempfile.TemporaryDirectory(prefix="kvfleet-request-ab-") as tmp:
        base = Path(tmp) / "base"
        git = ["git", "-C", str(REPO), "worktree"]
        subprocess.run([*git, "add", "--detach", str(base), args.base], check=True)
        try:
            ms = _measure({"base": base, "this": REPO}, flags, args)
        finally:
            subprocess.run([*git, "remove", "--force", str(base)], check=True)
    print(f"\nbase {args.base} vs this tree, {args.reps} repetitions; launch flags {' '.join(flags)}")
    print(f"{args.requests} requests per route, {args.concurrency} in flight, {args.max_tokens} tokens each")
    print(f"{'route':<24}{'base ms/req':>13}{'this ms/req':>13}   this / base (median, min-max)")
    for route in ROUTES:
        base_ms, this_ms = ms["base"][route], ms["this"][route]
        ratios = [t / b for t, b in zip(this_ms, base_ms, strict=True)]
        spread = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})"
        print(f"{route:<24}{statistics.median(base_ms):>13.1f}{statistics.median(this_ms):>13.1f}   {spread}")


def _measure(trees: dict[str, Path], flags: list[str], args) -> dict[str, dict[str, list[float]]]:
    """Per tree and route, the ms per request of each repetition (both workers up for the whole run)."""
    servers = {
        name: ServerProcess(
            flags,
            timeout=600.0,  # a loaded machine can take minutes to import and load the model
            env={"PYTHONPATH": str(tree)},
            launcher=[sys.executable, "-P", "-m", "engine.launch_server"],
        )
        for name, tree in trees.items()
    }
    ms: dict[str, dict[str, list[float]]] = {name: {r: [] for r in ROUTES} for name in trees}
    with servers["base"], servers["this"]:
        for name in trees:  # warm-up: first requests load lazy state (tokenizer caches, kernels)
            for route in ROUTES:
                asyncio.run(_round(servers[name].url, route, 4, 2, args.max_tokens))
        for rep in range(args.reps):
            for name in ("base", "this") if rep % 2 == 0 else ("this", "base"):
                for route in ROUTES:
                    value = asyncio.run(
                        _round(servers[name].url, route, args.requests, args.concurrency, args.max_tokens)
                    )
                    ms[name][route].append(value)
            print(f"repetition {rep}: load {os.getloadavg()[0]:.1f}", flush=True)
    return ms


if __name__ == "__main__":
    main()
