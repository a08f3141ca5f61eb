"""PD vs aggregated on the same two cores, behind the real router (smg), under the same mixed load.

``python -m engine.bench.pd_fleet [--duration S] [--quick]`` runs the workload twice, each time on fresh
processes:

* ``pd``: 1 prefill worker pinned to core 0 + 1 decode worker pinned to core 1 (``--disaggregation-mode``,
  Mooncake TransferEngine), router ``--pd-disaggregation`` (prefill cache_aware, decode round_robin);
* ``aggregated``: 2 workers, one pinned to each core, router round_robin.

Workers run SmolLM2-135M with ``OMP_NUM_THREADS=1`` (one core each; pinning is applied to every thread of
the worker). Workload: ``--decoders`` streaming clients in a loop, each a short random prompt
(``--short-prompt`` tokens) decoding ``--decode-tokens`` tokens, while one client sends a long random prompt
(``--long-prompt`` tokens, ``--long-output`` tokens), waits for it, pauses ``--long-interval`` seconds
and sends the next: long prefills arriving while others decode, never piling up. Random token ids, so no
request hits the prefix cache.
Reports, per setup: ITL p50/p99 of the decoding streams (gap between stream frames / tokens in the frame),
TTFT p50/p99 of the short and of the long requests, output tokens/s, errors; then PD/aggregated ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import time
from contextlib import ExitStack
from datetime import UTC, datetime

import httpx

from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess, worker_args
from engine.ports import free_port

VOCAB = 49152  # SmolLM2
WORKER_FLAGS = ["--model-path", "smollm2", "--page-size", "16", "--max-total-tokens", "8192",
                "--chunked-prefill-size", "256", "--enable-metrics"]  # fmt: skip


def _pin(pid: int, core: int) -> None:
    """Pin every thread of ``pid`` to ``core`` (threads started before the call included)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {core})


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def start_setup(stack: ExitStack, setup: str) -> str:
    """Start the workers and the router of ``setup`` (``pd`` or ``aggregated``); returns the router URL."""
    env = {"OMP_NUM_THREADS": "1", "GLOG_minloglevel": "2"}
    if setup == "pd":
        bootstrap = free_port()
        p_flags = ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)]
        prefill = stack.enter_context(ServerProcess([*WORKER_FLAGS, *p_flags], env=env))
        decode = stack.enter_context(
            ServerProcess([*WORKER_FLAGS, "--disaggregation-mode", "decode"], env=env)
        )
        _pin(prefill.proc.pid, 0)
        _pin(decode.proc.pid, 1)
        args = ["--pd-disaggregation", "--prefill", prefill.url, str(bootstrap), "--decode", decode.url,
                "--prefill-policy", "cache_aware", "--decode-policy", "round_robin"]  # fmt: skip
    else:
        workers = [stack.enter_context(ServerProcess(WORKER_FLAGS, env=env)) for _ in range(2)]
        for core, w in enumerate(workers):
            _pin(w.proc.pid, core)
        args = worker_args([w.url for w in workers], policy="round_robin")
    return stack.enter_context(RouterProcess(args)).url


async def _stream(client: httpx.AsyncClient, n_prompt: int, n_out: int, rng: random.Random) -> dict:
    """One streamed /generate of a random prompt: ttft (s), itls (s per token), tokens, or error."""
    body = {"input_ids": [rng.randrange(100, VOCAB) for _ in range(n_prompt)], "stream": True,
            "sampling_params": {"max_new_tokens": n_out, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    start = time.perf_counter()
    last_t, last_n, ttft, itls = start, 0, None, []
    try:
        async with client.stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": str(chunk["error"])[:200]}
                n, now = len(chunk.get("output_ids", [])), time.perf_counter()
                if n > last_n:
                    if ttft is None:
                        ttft = now - start
                    else:
                        itls += [(now - last_t) / (n - last_n)] * (n - last_n)
                    last_t, last_n = now, n
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"ttft": ttft or float("nan"), "itls": itls, "tokens": last_n}


async def run_load(url: str, a: argparse.Namespace) -> dict:
    short, long_, stop = [], [], asyncio.Event()
    rng = random.Random(0)

    async def decoder(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            short.append(await _stream(client, a.short_prompt, a.decode_tokens, rng))

    async def prefiller(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            long_.append(await _stream(client, a.long_prompt, a.long_output, rng))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), a.long_interval)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await _stream(client, 16, 2, rng)  # warm-up through the whole path
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(decoder(client)) for _ in range(a.decoders)]
        tasks.append(asyncio.ensure_future(prefiller(client)))
        await asyncio.sleep(a.duration)
        stop.set()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    ok_short = [r for r in short if "error" not in r]
    ok_long = [r for r in long_ if "error" not in r]
    itls = [x for r in ok_short for x in r["itls"]]
    errors = [r["error"] for r in short + long_ if "error" in r]
    return {
        "itl_p50": _percentile(itls, 50), "itl_p99": _percentile(itls, 99),
        "ttft_short_p50": _percentile([r["ttft"] for r in ok_short], 50),
        "ttft_short_p99": _percentile([r["ttft"] for r in ok_short], 99),
        "ttft_long_p50": _percentile([r["ttft"] for r in ok_long], 50),
        "ttft_long_p99": _percentile([r["ttft"] for r in ok_long], 99),
        "tok_s": sum(r["tokens"] for r in ok_short + ok_long) / elapsed,
        "requests": len(ok_short) + len(ok_long), "errors": len(errors),
        "first_error": errors[0] if errors else "",
    }  # fmt: skip


COLUMNS = [("itl_p50", "ITL p50 ms", 1e3), ("itl_p99", "ITL p99 ms", 1e3),
           ("ttft_short_p50", "short TTFT p50 ms", 1e3), ("ttft_short_p99", "short TTFT p99 ms", 1e3),
           ("ttft_long_p50", "long TTFT p50 ms", 1e3), ("ttft_long_p99", "long TTFT p99 ms", 1e3),
           ("tok_s", "output tok/s", 1)]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=90.0, help="seconds of load per setup")
    p.add_argument("--decoders", type=int, default=2)
    p.add_argument("--short-prompt", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--long-prompt", type=int, default=512)
    p.add_argument("--long-output", type=int, default=4)
    p.add_argument("--long-interval", type=float, default=2.0)
    p.add_argument("--setups", default="pd,aggregated")
    p.add_argument("--quick", action="store_true", help="30 s per setup (a smoke run, not the figures)")
    a = p.parse_args(argv)
    if a.quick:
        a.duration = 30.0
    print(f"# KVFleet PD vs aggregated, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, "
          f"{a.duration:g} s per setup; {a.decoders} decoders "
          f"({a.short_prompt} -> {a.decode_tokens} tokens), "
          f"{a.long_prompt}-token prompts, {a.long_interval:g} s apart")  # fmt: skip
    results = {}
    for setup in a.setups.split(","):
        with ExitStack() as stack:
            results[setup] = asyncio.run(run_load(start_setup(stack, setup), a))
    print("\n| setup | " + " | ".join(c[1] for c in COLUMNS) + " | requests | errors |")
    print("|---|" + "---:|" * (len(COLUMNS) + 2))
    for setup, r in results.items():
        cells = [f"{r[k] * scale:.1f}" for k, _, scale in COLUMNS]
        print(f"| {setup} | " + " | ".join(cells) + f" | {r['requests']} | {r['errors']} |")
    if {"pd", "aggregated"} <= set(results):
        pd, agg = results["pd"], results["aggregated"]
        cells = [f"{pd[k] / agg[k]:.2f}" if agg[k] else "n/a" for k, _, _ in COLUMNS]
        print("| pd / aggregated | " + " | ".join(cells) + " | | |")
    for setup, r in results.items():
        if r["errors"]:
            print(f"\n{setup}: first error: {r['first_error']}")


if __name__ == "__main__":
    main()
