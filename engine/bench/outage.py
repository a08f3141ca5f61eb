"""Closed-loop ``/generate`` traffic for L3 outage runs: the e2e test and the outage benchmark share it.

``Traffic(url, prompts, clients)`` runs ``clients`` threads, each sending the prompts round robin (one at a
time, greedy, ``max_new_tokens`` tokens) until ``stop()``; every answer is a ``Result`` (HTTP status, the
worker's ``meta_info.ttft`` in seconds, output ids, cached tokens per tier, the phase label current when the
request was sent). ``phase(label)`` switches the label. ``main`` is the outage benchmark (``_BENCH_DOC``).
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from dataclasses import dataclass

import httpx

from engine.bench.launcher import ServerProcess
from engine.fleet.mooncake_master import MooncakeMaster


@dataclass
class Result:
    phase: str
    prompt: int  # index into the prompts
    status: int
    ttft_s: float | None
    output_ids: list
    cached: dict  # device / host / storage tokens
    error: str = ""


class Traffic:
    def __init__(self, url: str, prompts: list[list[int]], clients: int = 4, max_new_tokens: int = 4):
        self.url, self.prompts, self.max_new_tokens = url, prompts, max_new_tokens
        self.results: list[Result] = []
        self._phase = "warmup"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def phase(self, label: str) -> None:
        self._phase = label

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)

    def of(self, phase: str) -> list[Result]:
        with self._lock:
            return [r for r in self.results if r.phase == phase]

    def _run(self, client: int) -> None:
        n = len(self.prompts)
        i = client * max(1, n // max(1, len(self._threads)))
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not self._stop.is_set():
                k = i % n
                i += 1
                phase = self._phase
                body = {
                    "input_ids": self.prompts[k],
                    "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0},
                }
                try:
                    resp = http.post("/generate", json=body)
                except httpx.HTTPError as exc:
                    result = Result(phase, k, 0, None, [], {}, f"{type(exc).__name__}: {exc}")
                else:
                    if resp.status_code == 200:
                        out = resp.json()
                        meta = out["meta_info"]
                        result = Result(phase, k, 200, meta.get("ttft"), out["output_ids"],
                                        dict(meta["cached_tokens_details"]))  # fmt: skip
                    else:
                        result = Result(phase, k, resp.status_code, None, [], {}, resp.text[:300])
                with self._lock:
                    self.results.append(result)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; raises ValueError when empty."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


def metric(url: str, name: str, **labels) -> float | None:
    """Sum of the samples of ``name`` in the worker's ``/metrics`` matching ``labels``; None when absent."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{")[0] == name and all(f'{k}="{v}"' in line for k, v in labels.items())
    ]
    return sum(values) if values else None


def wait_for(check, timeout: float, what: str, interval: float = 0.1):
    """Poll ``check()`` until it returns a truthy value; raises ``TimeoutError`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not seen within {timeout:.0f} s")


# ------------------------------------------------------------------------------------------- the benchmark
def _worker_flags(args, master: MooncakeMaster | None) -> list[str]:
    flags = [
        "--model-path", args.model_path, "--page-size", str(args.page_size),
        "--max-total-tokens", str(args.max_total_tokens), "--enable-hierarchical-cache",
        "--hicache-ratio", "2", "--enable-metrics", "--enable-cache-report",
    ]  # fmt: skip
    if master is not None:
        extra = {
            "master_server_address": master.master_address, "metadata_server": master.metadata_url,
            "protocol": "tcp", "global_segment_size": "512mb", "local_buffer_size": "64mb",
            "prefetch_threshold": args.page_size,
        }  # fmt: skip
        flags += ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config",
                  json.dumps(extra), "--hicache-storage-prefetch-policy", "timeout"]  # fmt: skip
    return flags


def _run_phase(url: str, prompts: list[list[int]], clients: int, seconds: float, label: str) -> list[float]:
    with Traffic(url, prompts, clients) as traffic:
        traffic.phase(label)
        time.sleep(seconds)  # a fixed measurement window, not a wait for an event
    bad = [r for r in traffic.results if r.status != 200]
    if bad:
        raise RuntimeError(f"{label}: {len(bad)} failed requests, e.g. {bad[0].status} {bad[0].error}")
    return [r.ttft_s for r in traffic.results if r.ttft_s is not None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.outage", description=_BENCH_DOC)
    p.add_argument("--model-path", default="smollm2")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=2048)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--seconds", type=float, default=20.0, help="per phase and round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    rng = random.Random(24)
    prompts = [[rng.randrange(100, 10000) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    with (
        MooncakeMaster() as master,
        ServerProcess(_worker_flags(args, master), timeout=600) as l3,
        ServerProcess(_worker_flags(args, None), timeout=600) as plain,
    ):
        healthy = _run_phase(l3.url, prompts, args.clients, args.seconds, "healthy L3")
        master.kill()
        with Traffic(l3.url, prompts, args.clients):
            state = "sglang:hicache_storage_breaker_state"
            wait_for(lambda: metric(l3.url, state) == 2, 120, "breaker open")
        ttft: dict[str, list[float]] = {"no L3": [], "L3 outage": []}
        for _ in range(args.rounds):  # alternating, so both see the same machine load
            ttft["no L3"] += _run_phase(plain.url, prompts, args.clients, args.seconds, "no L3")
            ttft["L3 outage"] += _run_phase(l3.url, prompts, args.clients, args.seconds, "L3 outage")
        short = metric(l3.url, "sglang:hicache_storage_breaker_short_circuited_total")
    print(f"{args.model_path}: {args.prompts} prompts x {args.prompt_tokens} tokens, {args.clients} clients, "
          f"{args.rounds} rounds x {args.seconds:g} s per phase; L3 lookups skipped: {short:g}")  # fmt: skip
    print(f"{'phase':12} {'requests':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}")
    rows = {"healthy L3": healthy, **ttft}
    for name, values in rows.items():
        p50, p99 = (percentile(values, q) * 1e3 for q in (0.5, 0.99))
        print(f"{name:12} {len(values):8d} {p50:12.1f} {p99:12.1f}")
    for q in (0.5, 0.99):
        ratio = percentile(ttft["L3 outage"], q) / percentile(ttft["no L3"], q)
        print(f"L3 outage / no L3, TTFT p{int(q * 100)}: {ratio:.2f}x (target <= 1.1x)")
    return 0


_BENCH_DOC = """TTFT during an L3 outage against the same traffic on a worker with no L3 (same run).

``python -m engine.bench.outage [--model-path smollm2] [--seconds 20] [--rounds 3]`` starts a Mooncake master
and two workers with the same flags, one with the Mooncake L3 and one without. It measures the L3 worker
healthy, kills the master, waits for the breaker to open under traffic, then alternates phases of the same
closed-loop traffic (``--clients`` clients over ``--prompts`` random prompts that do not fit L1 + L2, so
every lookup reaches L3) on the no-L3 worker and the outage worker. Prints TTFT p50/p99 per phase (the
worker's ``meta_info.ttft``) and the outage / no-L3 ratios; target <= 1.1x.
"""

if __name__ == "__main__":
    raise SystemExit(main())
