"""Check an upstream SGLang worker's hierarchical cache as KVFleet drives it, and print a table.

``python -m engine.bench.upstream --python /opt/sglang/bin/python --model /models/X`` on a GPU host: starts
upstream's unmodified ``sglang.launch_server`` (HiCache on, its default io backend and layout, an admin key
handed over by the agent's bootstrap, ``engine/agent/engines.py``) and runs the scenarios KVFleet's tests run
on a CPU host with stand-ins: an L1 hit, an L2 hit after L1 evicted the prefix, a runtime attach of a file
L3 (``PUT /hicache/storage-backend``), an L3 hit after ``/flush_cache`` with the same greedy output, the idle
reading from ``/v1/loads``, and the detach. ``--cpu`` adds the CPU stand-ins of tests/support/sglang_cpu/
(so the script itself can be checked without a GPU). Exit status 1 when a scenario does not hold.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import httpx

from engine.agent.engines import SGLANG, launch_command
from engine.bench.upstream_cpu import CPU_WORKER_ENV, cpu_command_line
from engine.ports import free_port

KEY = "bench-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _generate(url: str, text: str) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    start = time.perf_counter()
    answer = httpx.post(f"{url}/generate", json=body, timeout=600).json()
    answer["seconds"] = time.perf_counter() - start
    return answer


def _start(args, port: int, l3: str) -> subprocess.Popen:
    flags = [f"--model-path={args.model}", f"--port={port}", "--host=127.0.0.1", "--page-size=16",
             f"--max-total-tokens={args.l1_tokens}", "--enable-hierarchical-cache", "--hicache-ratio=2",
             "--enable-metrics"]  # fmt: skip
    env = {**os.environ, "KVFLEET_ADMIN_API_KEY": KEY, "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": l3}
    if args.cpu:
        flags += cpu_command_line()
        env.update(CPU_WORKER_ENV)
    return subprocess.Popen(
        launch_command(SGLANG, flags, args.python, env), env=env, stdout=subprocess.DEVNULL
    )


def _wait(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"upstream exited with {proc.returncode} before answering")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"upstream not healthy after {timeout:.0f} s")


def run(args) -> list[tuple[str, dict, bool]]:
    """(scenario, the answer's meta_info with its seconds, held) rows."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    words = args.l1_tokens // 7  # ~3.6 tokens a word: two prompts overflow L1, one fits
    a = " ".join(f"alpha{i}" for i in range(words))
    b = " ".join(f"beta{i}" for i in range(words))
    with tempfile.TemporaryDirectory() as l3:
        proc = _start(args, port, l3)
        try:
            _wait(url, proc, args.start_timeout)
            rows = []

            def row(name: str, answer: dict, tier: str) -> dict:
                meta = {**answer["meta_info"], "seconds": answer["seconds"]}
                rows.append((name, meta, (meta.get("cached_tokens_details") or {}).get(tier, 0) >= 16))
                return answer

            cold = _generate(url, a)
            rows.append(("cold", {**cold["meta_info"], "seconds": cold["seconds"]}, True))
            row("L1 hit", _generate(url, a), "device")
            _generate(url, b)
            row("L2 hit (L1 evicted)", _generate(url, a), "host")
            put = {"hicache_storage_backend": "file"}
            ok = httpx.put(f"{url}/hicache/storage-backend", json=put, headers=AUTH, timeout=120)
            rows.append(("attach file L3", {"status": ok.status_code, "seconds": 0.0}, ok.status_code == 200))
            _generate(url, b)
            loads = httpx.get(f"{url}/v1/loads", timeout=10).json()["loads"]
            idle = all(r["num_running_reqs"] == r["num_waiting_reqs"] == 0 for r in loads)
            rows.append(("idle from /v1/loads", {"seconds": 0.0}, idle))
            flushed = httpx.post(f"{url}/flush_cache", headers=AUTH, timeout=60).status_code == 200
            again = row("L3 hit after flush", _generate(url, b), "storage")
            rows[-1] = (rows[-1][0], rows[-1][1], rows[-1][2] and flushed)
            rows.append(("same greedy output", {"seconds": 0.0}, again["text"] == _generate(url, b)["text"]))
            gone = (
                httpx.delete(f"{url}/hicache/storage-backend", headers=AUTH, timeout=120).status_code == 200
            )
            rows.append(("detach", {"seconds": 0.0}, gone))
            return rows
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="the interpreter of the SGLang environment")
    parser.add_argument("--model", required=True, help="an HF model folder upstream can load")
    parser.add_argument("--l1-tokens", type=int, default=2048, help="--max-total-tokens (default 2048)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /health")
    parser.add_argument("--cpu", action="store_true", help="CPU host: add the test-only stand-ins")
    rows = run(parser.parse_args(argv))
    print(f"{'scenario':<24} {'device':>7} {'host':>7} {'storage':>8} {'seconds':>8}  held")
    for name, meta, held in rows:
        tiers = meta.get("cached_tokens_details") or {}
        cells = [str(tiers.get(t, "")) for t in ("device", "host", "storage")]
        print(f"{name:<24} {cells[0]:>7} {cells[1]:>7} {cells[2]:>8} {meta['seconds']:>8.2f}  {held}")
    return 0 if all(held for _, _, held in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
