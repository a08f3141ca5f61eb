"""``n`` samples of one prompt in one request against ``n`` separate requests of the same prompt.

One server (default: SmolLM2-135M, fp32, a fresh L1 for each side: ``/flush_cache`` before each) gets, in the
same run, ``/v1/completions`` with ``n`` (the prompt computed once, the samples reusing its KV through
the prefix cache) and two baselines: ``n`` concurrent ``/v1/completions`` of the same prompt with n 1 (what
an SDK loop or a proxy that splits ``n`` sends; those arriving while the first is being prefilled find its
prefix cached) and one ``/generate`` batch of ``n`` copies (they arrive together and share one prefill
batch, so none finds the others' prefix). Reports, for each side, the prompt tokens the server computed
(from its ``/metrics``: the change of ``sglang:prompt_tokens_total`` minus that of
``sglang:cached_tokens_total``, so the n-request's prompt-only first pass counts) and the wall time, then
the ratios of the n-request to each baseline.
Prints a markdown table; ``--json`` prints the numbers instead.
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

TIMEOUT = 600.0


async def _one(client: httpx.AsyncClient, prompt: list[int], n: int, max_tokens: int, seed: int) -> dict:
    body = {"prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "ignore_eos": True}  # fmt: skip
    resp = await client.post("/v1/completions", json=body)
    resp.raise_for_status()
    return resp.json()


async def run_side(url: str, prompt: list[int], n: int, max_tokens: int, side: str) -> dict:
    """One side: ``n`` samples in one request (``n``), as ``n`` concurrent requests (``concurrent``) or as a
    batch of ``n`` copies in one ``/generate`` (``batch``); returns the prompt tokens computed and the wall
    time (seconds)."""
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        (await client.post("/flush_cache")).raise_for_status()
        before = await _computed(client)
        start = time.perf_counter()
        if side == "n":
            await _one(client, prompt, n, max_tokens, seed=1)
        elif side == "concurrent":
            await asyncio.gather(*(_one(client, prompt, 1, max_tokens, seed=1 + j) for j in range(n)))
        else:  # one /generate batch of n copies: they arrive together, in one prefill batch
            params = [{"max_new_tokens": max_tokens, "temperature": 1.0, "sampling_seed": 1 + j,
                       "ignore_eos": True} for j in range(n)]  # fmt: skip
            body = {"input_ids": [prompt] * n, "sampling_params": params}
            (await client.post("/generate", json=body)).raise_for_status()
        wall = time.perf_counter() - start
        computed = await _computed(client) - before
    return {"prefill_tokens": computed, "wall_s": wall}


async def _computed(client: httpx.AsyncClient) -> float:
    """Prompt tokens the server computed so far: admitted prompt tokens minus those served from a cache."""
    lines = (await client.get("/metrics")).text.splitlines()
    admitted = sum(float(x.split()[-1]) for x in lines if x.startswith("sglang:prompt_tokens_total"))
    cached = sum(float(x.split()[-1]) for x in lines if x.startswith("sglang:cached_tokens_total"))
    return admitted - cached


def measure(url: str, prompt_len: int, n: int, max_tokens: int, repeats: int) -> dict:
    """Both sides ``repeats`` times, alternating; medians of the wall times."""
    rng = random.Random(0)
    prompt = [rng.randrange(100, 20000) for _ in range(prompt_len)]
    sides = ("n", "concurrent", "batch")
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side in sides:
            runs[side].append(asyncio.run(run_side(url, prompt, n, max_tokens, side)))
    out: dict = {}
    for side, results in runs.items():
        out[side] = {
            "prefill_tokens": statistics.median(r["prefill_tokens"] for r in results),
            "wall_s": statistics.median(r["wall_s"] for r in results),
        }
    for side in ("concurrent", "batch"):
        out[f"prefill_ratio_vs_{side}"] = out["n"]["prefill_tokens"] / out[side]["prefill_tokens"]
        out[f"wall_ratio_vs_{side}"] = out["n"]["wall_s"] / out[side]["wall_s"]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--url", help="a running server (started with --enable-metrics) instead of launching")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.url:
        res = measure(a.url, a.prompt_len, a.n, a.max_tokens, a.repeats)
    else:
        flags = ["--model-path", a.model_path, "--enable-metrics", "--max-total-tokens", "8192"]
        with ServerProcess(flags, timeout=600) as server:
            res = measure(server.url, a.prompt_len, a.n, a.max_tokens, a.repeats)
    if a.json:
        print(json.dumps(res, indent=2))
        return
    print("| side | prompt tokens computed | wall time (s) |\n|---|---:|---:|")
    names = {
        "concurrent": f"{a.n} concurrent requests (baseline)",
        "batch": f"{a.n} copies in one batch (baseline)",
        "n": f"one request, n={a.n}",
    }
    for side, name in names.items():
        print(f"| {name} | {res[side]['prefill_tokens']:,.0f} | {res[side]['wall_s']:.2f} |")
    for side in ("concurrent", "batch"):
        print(f"\nn / {side}: prefill tokens ratio {res[f'prefill_ratio_vs_{side}']:.3f}, "
              f"wall time ratio {res[f'wall_ratio_vs_{side}']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
