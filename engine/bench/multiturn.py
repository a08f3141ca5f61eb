"""Multi-turn benchmark for an engine worker, modelled on SGLang's ``bench_multiturn``.

Workload: N clients, each with its own context (``--context-length`` tokens, e.g. a document), talk for R
rounds; every round appends ``--request-length`` new tokens, asks for ``--output-length`` tokens (greedy,
``ignore_eos``) and keeps the answer in the history, so round r's prompt extends round r-1's. Rounds run in
lock step; inside a round at most ``--max-parallel`` requests are in flight and requests start at
``--request-rate`` per second (Poisson; ``inf`` = back to back). Alternatively ``--trace`` replays a Mooncake
trace scaled down by ``--trace-scale`` (lengths and 512-token blocks divided by k; hash ids map to fixed
pseudo-random token blocks).

Reports TTFT (mean/p50/p90, streamed ``/generate``: time to the first output token), throughput and the
cached prompt tokens per tier (``meta_info.cached_tokens_details``). Round 0 is cold; later rounds are the
"warm" requests whose prefix may be cached.

``--compare`` launches the same workload on three fresh servers with the same L1 size: no hierarchical
cache, L2 (``--enable-hierarchical-cache``), L2 + file L3 with ``/flush_cache`` before every warm round (so
the prefix must come back from L3), with ``--mooncake`` a fourth with a Mooncake L3 (a real master started
for the run); and adds the physical limit of each warm request: its cached bytes copied at this machine's
plain-copy speed plus the prefill time of its uncached tokens alone. ``--upstream-python`` runs the three
on upstream SGLang too (same model, same workload). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import torch

from engine.agent.engines import SGLANG, launch_command
from engine.bench.launcher import ServerProcess
from engine.bench.upstream_cpu import CPU_WORKER_ENV, cpu_command_line
from engine.fleet.mooncake_master import MooncakeMaster

REQUEST_TIMEOUT = 600.0  # seconds; a request slower than this fails the run instead of hanging it


@dataclass
class Result:
    """One request's measurements (seconds, tokens)."""

    round: int
    prompt_tokens: int
    output_tokens: int
    ttft: float
    latency: float
    cached: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- client
async def send(client: httpx.AsyncClient, input_ids: list[int], output_len: int) -> tuple[list[int], Result]:
    """Stream one greedy ``/generate``; returns the output ids and the measurements (round unset)."""
    sp = {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": input_ids, "stream": True, "sampling_params": sp}
    start = time.perf_counter()
    ttft, last = None, None
    async with client.stream("POST", "/generate", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"/generate answered {resp.status_code}: {(await resp.aread()).decode()}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"/generate failed: {chunk['error']}")
            if ttft is None and chunk["output_ids"]:
                ttft = time.perf_counter() - start
            last = chunk
    meta = last["meta_info"]
    # upstream SGLang reports the per-tier split only with its hierarchical cache on: else all is device
    tiers = meta.get("cached_tokens_details") or {"device": meta.get("cached_tokens", 0)}
    res = Result(-1, meta["prompt_tokens"], len(last["output_ids"]), ttft or 0.0, time.perf_counter() - start,
                 {k: int(tiers.get(k) or 0) for k in ("device", "host", "storage")})  # fmt: skip
    return last["output_ids"], res


async def flush_when_idle(client: httpx.AsyncClient, timeout: float = 120.0) -> None:
    """POST /flush_cache until accepted (refused while requests or cache I/O are in flight)."""
    deadline = time.monotonic() + timeout
    while (await client.post("/flush_cache")).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("server never became idle for /flush_cache")
        await asyncio.sleep(0.1)


class _Pacer:
    """Poisson request starts at ``rate`` per second (no waiting when rate is inf)."""

    def __init__(self, rate: float, rng: random.Random):
        self.rate, self.rng, self.next = rate, rng, time.perf_counter()

    async def wait(self) -> None:
        if math.isinf(self.rate):
            return
        self.next += self.rng.expovariate(self.rate)
        await asyncio.sleep(max(0.0, self.next - time.perf_counter()))


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo, hi = vocab // 10, vocab * 9 // 10  # stay clear of special and rare tokens
    return [rng.randrange(lo, hi) for _ in range(n)]


async def run_multiturn(url: str, a: argparse.Namespace, vocab: int, flush_between_rounds: bool = False,
                        headers: dict | None = None) -> list[Result]:  # fmt: skip
    """Run the multi-turn workload against ``url``; returns every request's Result. ``headers`` go with
    every call (upstream's ``/flush_cache`` needs its admin key)."""
    rng = random.Random(a.seed)
    histories = [_tokens(rng, a.context_length, vocab) for _ in range(a.num_clients)]
    turns = [
        [_tokens(rng, a.request_length, vocab) for _ in range(a.num_rounds)] for _ in range(a.num_clients)
    ]
    results: list[Result] = []
    sem = asyncio.Semaphore(a.max_parallel)
    pacer = _Pacer(a.request_rate, rng)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT, headers=headers) as client:

        async def one(c: int, r: int) -> None:
            await pacer.wait()
            async with sem:
                prompt = histories[c] + turns[c][r]
                out, res = await send(client, prompt, a.output_length)
            histories[c] = prompt + out
            res.round = r
            results.append(res)

        for r in range(a.num_rounds):
            if r > 0 and flush_between_rounds:
                await flush_when_idle(client)
            await asyncio.gather(*(one(c, r) for c in range(a.num_clients)))
    return results


def trace_requests(
    path: str, scale: int, max_requests: int, vocab: int
) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt ids, output length) of the first ``max_requests`` trace lines, scaled by 1/k."""
    block = max(1, 512 // scale)
    blocks: dict[int, list[int]] = {}
    out = []
    with open(path) as f:
        for line in f:
            if len(out) >= max_requests:
                break
            rec = json.loads(line)
            ids: list[int] = []
            for h in rec["hash_ids"]:
                if h not in blocks:
                    blocks[h] = _tokens(random.Random(h), block, vocab)
                ids += blocks[h]
            n_in = max(1, rec["input_length"] // scale)
            out.append((rec["timestamp"] / 1000.0, ids[:n_in], max(1, rec["output_length"] // scale)))
    return out


async def run_trace(url: str, a: argparse.Namespace, vocab: int) -> list[Result]:
    """Replay a scaled trace: requests start at their (sped-up) timestamps, ``max_parallel`` at most.

    A prompt longer than the server's context allows (with its output) keeps only its head."""
    context = httpx.get(f"{url}/server_info", timeout=10).json()["context_length"]
    reqs = [(at, ids[: context - n_out - 1], n_out)
            for at, ids, n_out in trace_requests(a.trace, a.trace_scale, a.max_requests, vocab)]  # fmt: skip
    sem = asyncio.Semaphore(a.max_parallel)
    results: list[Result] = []
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT) as client:

        async def one(at: float, ids: list[int], n_out: int) -> None:
            await asyncio.sleep(max(0.0, start + at / a.trace_speedup - time.perf_counter()))
            async with sem:
                _, res = await send(client, ids, n_out)
            res.round = 1
            results.append(res)

        await asyncio.gather(*(one(*r) for r in reqs))
    return results


# ----------------------------------------------------------------------------------------------- summary
def summarize(results: list[Result], wall: float, warm_only: bool = True) -> dict:
    """TTFT stats (seconds) over the warm requests, throughput over all, cached tokens per tier (warm)."""
    warm = [r for r in results if r.round > 0] if warm_only else results
    warm = warm or results
    ttfts = sorted(r.ttft for r in warm)
    cached = {k: sum(r.cached.get(k, 0) for r in warm) for k in ("device", "host", "storage")}
    return {
        "requests": len(results),
        "ttft_mean": statistics.fmean(ttfts),
        "ttft_p50": _pct(ttfts, 50),
        "ttft_p90": _pct(ttfts, 90),
        "cold_ttft_mean": statistics.fmean([r.ttft for r in results if r.round == 0] or [math.nan]),
        "output_tok_per_s": sum(r.output_tokens for r in results) / wall,
        "req_per_s": len(results) / wall,
        "warm_prompt_tokens": sum(r.prompt_tokens for r in warm),
        "cached": cached,
    }


def _pct(sorted_vals: list[float], p: float) -> float:
    if not sorted_vals:
        return math.nan
    k = (len(sorted_vals) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def copy_bandwidth(nbytes: int) -> float:
    """Plain contiguous copy speed on this machine (bytes/s, best of 5) for a buffer of ``nbytes``."""
    src = torch.empty(max(1, nbytes // 4), dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return src.numel() * 4 / best


# ----------------------------------------------------------------------------------------------- compare
def _server_flags(a: argparse.Namespace) -> list[str]:
    return ["--model-path", a.model_path, "--max-total-tokens", str(a.max_total_tokens), "--page-size",
            str(a.page_size), "--chunked-prefill-size", str(a.chunked_prefill_size)]  # fmt: skip


def _model_facts(url: str) -> dict:
    return httpx.get(f"{url}/model_info", timeout=10).json()


NO_CACHE, L2, L3 = "no hierarchical cache", "L2 (host)", "L2 + file L3, flushed before each warm round"
MC = "L2 + Mooncake L3, flushed before each warm round"
UPSTREAM_KEY = (
    "bench-admin-key"  # upstream's /flush_cache is admin-gated; the key goes through the environment
)


def _configs(
    a: argparse.Namespace, l3_dir: str, upstream: bool, master=None
) -> list[tuple[str, list[str], bool]]:
    """(name, launch flags, flush before each warm round) of the configurations, in run order: three, and
    a Mooncake L3 on KVFleet with ``master`` (a running :class:`MooncakeMaster`)."""
    base = _server_flags(a)
    l2 = [*base, "--enable-hierarchical-cache", "--hicache-ratio", str(a.hicache_ratio)]
    l3 = [*l2, "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy", "wait_complete"]
    if upstream:  # upstream's file backend takes its folder from the environment (see _upstream_env)
        cpu = cpu_command_line() if a.upstream_cpu else []
        return [(L2, [*l2, *cpu], False), (L3, [*l3, *cpu], True), (NO_CACHE, [*base, *cpu], False)]
    extra = json.dumps({"file_path": l3_dir, "prefetch_threshold": a.page_size * 4})
    configs = [(L2, l2, False), (L3, [*l3, "--hicache-storage-backend-extra-config", extra], True)]
    if master is not None:
        mc = {"master_server_address": master.master_address, "metadata_server": master.metadata_url,
              "protocol": "tcp", "global_segment_size": "512mb", "local_buffer_size": "64mb",
              "prefetch_threshold": a.page_size * 4}  # fmt: skip
        mooncake = ["--hicache-storage-backend", "mooncake", "--hicache-storage-prefetch-policy",
                    "wait_complete", "--hicache-storage-backend-extra-config", json.dumps(mc)]  # fmt: skip
        configs.append((MC, [*l2, *mooncake], True))
    return [*configs, (NO_CACHE, base, False)]


def _upstream_env(a: argparse.Namespace, l3_dir: str) -> dict:
    env = {"KVFLEET_ADMIN_API_KEY": UPSTREAM_KEY, "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": l3_dir}
    if a.upstream_cpu:  # the test-only stand-ins for what upstream's CPU build lacks
        env.update(CPU_WORKER_ENV)
    return env


def _run_engine(a: argparse.Namespace, upstream: bool, vocab: int | None) -> tuple[dict, dict]:
    """Run the configurations on one engine: (name -> summary, model facts: KVFleet's only, with the
    physical limit of its L2 run's warm requests)."""
    l3_dir = tempfile.mkdtemp(prefix="bench-l3-")
    rows: dict[str, dict] = {}
    facts: dict = {}
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(MooncakeMaster()) if a.mooncake and not upstream else None
        for name, flags, flush in _configs(a, l3_dir, upstream, master):
            env, launcher, headers = None, None, None
            if upstream:
                env = _upstream_env(a, l3_dir)
                launcher = launch_command(SGLANG, [], a.upstream_python, env)
                headers = {"Authorization": f"Bearer {UPSTREAM_KEY}"}
            with ServerProcess(flags, timeout=a.start_timeout, env=env, launcher=launcher) as server:
                if not upstream:
                    facts.update(_model_facts(server.url))
                t = time.perf_counter()
                results = asyncio.run(
                    run_multiturn(server.url, a, vocab or facts["vocab_size"], flush, headers=headers)
                )
                rows[name] = summarize(results, time.perf_counter() - t)
                rows[name]["results"] = results
                if name == NO_CACHE and not upstream:
                    facts.update(_physical_limit(server.url, a, facts, rows[L2]["results"]))
    return rows, facts


def _physical_limit(url: str, a: argparse.Namespace, facts: dict, l2_results: list[Result]) -> dict:
    """``phys``: per warm request of the L2 run, its cached bytes copied at this machine's plain-copy speed
    plus the prefill of its uncached tokens alone on the no-cache server at ``url`` (sorted, seconds);
    ``copy_bw`` that speed (bytes/s)."""
    warm = [r for r in l2_results if r.round > 0]
    bpt = facts["kv_bytes_per_token"]
    bw = copy_bandwidth(max(r.prompt_tokens for r in warm) * bpt)
    prefill_of = _uncached_prefill_probe(url, a, facts["vocab_size"])
    phys = sorted(
        sum(r.cached.values()) * bpt / bw + prefill_of(r.prompt_tokens - sum(r.cached.values())) for r in warm
    )
    return {"phys": phys, "copy_bw": bw}


def compare(a: argparse.Namespace) -> str:
    """Run the workload on the three configurations (and on upstream SGLang with ``--upstream-python``)
    and return the markdown table."""
    if a.upstream_python and a.model_path == "smollm2":  # one model both engines load: the HF folder
        from engine.fleet.hf_export import export

        a.model_path = str(export("smollm2"))
    rows, facts = _run_engine(a, False, None)
    up = _run_engine(a, True, facts["vocab_size"])[0] if a.upstream_python else {}
    bpt, bw, phys = facts["kv_bytes_per_token"], facts["copy_bw"], facts["phys"]
    lines = [
        f"Workload: {a.num_clients} clients x {a.num_rounds} rounds, context {a.context_length} tokens, "
        f"+{a.request_length} tokens/round, {a.output_length} output tokens, max {a.max_parallel} in flight; "
        f"L1 {a.max_total_tokens} tokens (page {a.page_size}), L2 ratio {a.hicache_ratio}; model "
        f"{a.model_path}. KV {bpt} B/token, plain copy {bw / 1e9:.2f} GB/s. TTFT over warm rounds "
        f"(1..{a.num_rounds - 1}).",
        "",
        "| engine | configuration | TTFT mean (s) | p50 (s) | p90 (s) | TTFT / its no-cache | cold TTFT (s) "
        "| output tok/s | cached device / host / storage (warm) | TTFT / upstream's |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for engine, table in (("KVFleet", rows), ("upstream SGLang", up)):
        for name in [n for n in (NO_CACHE, L2, L3, MC) if n in table]:
            s, c, base = table[name], table[name]["cached"], table[NO_CACHE]
            vs = (
                f"{s['ttft_mean'] / up[name]['ttft_mean']:.2f}x" if name in up and engine == "KVFleet" else ""
            )
            lines.append(
                f"| {engine} | {name} | {s['ttft_mean']:.3f} | {s['ttft_p50']:.3f} | {s['ttft_p90']:.3f} | "
                f"{s['ttft_mean'] / base['ttft_mean']:.1%} | {s['cold_ttft_mean']:.3f} | "
                f"{s['output_tok_per_s']:.2f} | {c['device']} / {c['host']} / {c['storage']} of "
                f"{s['warm_prompt_tokens']} | {vs} |"
            )
    lines.append(
        f"| KVFleet | physical limit (copy cached bytes + prefill uncached) | {statistics.fmean(phys):.3f} | "
        f"{_pct(phys, 50):.3f} | {_pct(phys, 90):.3f} | "
        f"{statistics.fmean(phys) / rows[NO_CACHE]['ttft_mean']:.1%} "
        "| | | | |"
    )
    return "\n".join(lines)


def _uncached_prefill_probe(url: str, a: argparse.Namespace, vocab: int):
    """TTFT of a cold prompt of n tokens on ``url`` (measured once per distinct n, fresh tokens each time)."""
    rng = random.Random(a.seed + 99)
    cache: dict[int, float] = {}

    async def probe(n: int) -> float:
        async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT) as client:
            _, res = await send(client, _tokens(rng, n, vocab), 1)
        return res.ttft

    def prefill_of(n: int) -> float:
        n = max(1, n)
        if n not in cache:
            cache[n] = asyncio.run(probe(n))
        return cache[n]

    return prefill_of


# ----------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.bench.multiturn", description=__doc__.split("\n")[0])
    p.add_argument("--url", help="benchmark a running server (otherwise --compare launches servers)")
    p.add_argument("--compare", action="store_true", help="run the 3 cache configurations + physical limit")
    p.add_argument("--num-clients", type=int, default=4)
    p.add_argument("--num-rounds", type=int, default=3)
    p.add_argument("--context-length", type=int, default=2048, help="per-client context before round 0")
    p.add_argument("--request-length", type=int, default=16, help="new tokens per round")
    p.add_argument("--output-length", type=int, default=4)
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--max-parallel", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--flush-between-rounds", action="store_true")
    p.add_argument("--trace", help="Mooncake trace .jsonl to replay instead of the synthetic workload")
    p.add_argument("--trace-scale", type=int, default=16, help="divide lengths and blocks by k")
    p.add_argument("--trace-speedup", type=float, default=1.0, help="divide trace timestamps by this")
    p.add_argument("--max-requests", type=int, default=32)
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--max-total-tokens", type=int, default=4096)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument(
        "--upstream-python",
        help="with --compare: also run upstream SGLang from this interpreter (make sglang-env prints it) "
        "on the same model (smollm2: its HF folder)",
    )
    p.add_argument("--upstream-cpu", action="store_true",
                   help="upstream on a CPU-only host: its CPU flags and the test-only stand-ins")  # fmt: skip
    p.add_argument("--mooncake", action="store_true", help="with --compare: add a Mooncake L3 run (KVFleet)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    if a.compare:
        print(compare(a))
        return
    if not a.url:
        raise SystemExit("give --url of a running server, or --compare")
    vocab = _model_facts(a.url)["vocab_size"]
    t = time.perf_counter()
    if a.trace:
        results = asyncio.run(run_trace(a.url, a, vocab))
    else:
        results = asyncio.run(run_multiturn(a.url, a, vocab, a.flush_between_rounds))
    print(json.dumps(summarize(results, time.perf_counter() - t, warm_only=not a.trace), indent=2))


if __name__ == "__main__":
    main()
