"""Decode inter-token latency at a long context: KVFleet's KV cache dtypes against llama.cpp's, one run.

``python -m engine.bench.long_context_itl [--context 3072] [--steps 32] [--reps 3] [--cpus 0,1] [--threads 1]
[--variants bfloat16+int4wo-32@1:kv=bfloat16 bfloat16+int4wo-32@1:kv=int8 ...] [--llama-cache-types f16
q8_0]``

Each repetition runs, in alternating order:

* KVFleet: ``engine.bench.decode_profile --batch 1 --rounds 1 --context C --steps N --variants ...`` in a
  fresh process (``engine.bench.ab.run_profile``): one sequence of C random tokens prefilled once in chunks
  through the extend path, copied into each variant's KV format, then N decode steps per variant, wall ms
  per step (median).
* llama.cpp: one ``llama-server`` per ``--llama-cache-types`` entry, one at a time (``-c`` C + N + 64,
  ``-np 1``, ``-t``/``-tb`` ``--threads``, ``--cache-type-k``/``--cache-type-v`` that type, flash attention
  on for every type: llama.cpp quantizes the V cache only with it) on the same SmolLM2 GGUF: a prompt of C
  random token ids (``cache_prompt`` off), N tokens generated (``ignore_eos``, greedy), its own
  ``timings.predicted_per_token_ms`` (the mean over the generated tokens, no HTTP in it).

Every entry's ratio to the first ``--variants`` entry of the same repetition (by default KVFleet's bfloat16
KV), median (min-max) over repetitions, and each llama.cpp type's ratio to the first llama.cpp type. This
process pins itself to ``--cpus`` first, so both engines and the client run on the same CPUs; the load
average is printed after each repetition. ``llama-server`` is found as ``engine.bench.peers`` finds it
(``make llama-server``); without it only KVFleet's rows are printed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx

from engine.bench.ab import REPO, run_profile
from engine.bench.peers import _cpus, llama_server_binary
from engine.model.loader import resolve_model_path
from engine.ports import free_port

FAST = "bfloat16+int4wo-32"  # the fast mode on a CPU (README.md, docs/model.md)
DEFAULT_VARIANTS = [f"{FAST}@1:kv={kv}" for kv in ("bfloat16", "int8", "fp8_e4m3")]


def llama_itl(binary: str, gguf: Path, cache_type: str, context: int, steps: int, threads: int) -> float:
    """llama-server's mean ms per generated token over ``steps`` tokens after a ``context``-token prompt,
    with its K and V cache in ``cache_type`` (f16, q8_0, ...). Its log goes to a temporary file (a pipe
    nobody reads while it runs could fill and stall it); its tail ends the error of a server that exits."""
    with tempfile.TemporaryFile("w+") as log:
        return _llama_itl(log, binary, gguf, cache_type, context, steps, threads)


def _llama_itl(
    log, binary: str, gguf: Path, cache_type: str, context: int, steps: int, threads: int
) -> float:
    """``llama_itl`` with the server's log going to the open file ``log``."""
    port = free_port()
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "1"]
    cmd += ["-c", str(context + steps + 64), "-t", str(threads), "-tb", str(threads), "-fa", "on"]
    cmd += ["--cache-type-k", cache_type, "--cache-type-v", cache_type]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(
                    f"llama-server ({cache_type}) exited with {proc.returncode}: {log.read()[-2000:]}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server ({cache_type}) not healthy within 180 s")
            time.sleep(0.2)
        rng = random.Random(context)
        body = {
            "prompt": [rng.randrange(100, 49152) for _ in range(context)],
            "n_predict": steps,
            "ignore_eos": True,
            "temperature": 0,
            "cache_prompt": False,
        }
        resp = httpx.post(f"{url}/completion", json=body, timeout=1800)
        resp.raise_for_status()
        timings = resp.json()["timings"]
        if timings["predicted_n"] < steps or timings["prompt_n"] < context:
            raise RuntimeError(f"llama-server ({cache_type}) ran {timings}, not {context} + {steps} tokens")
        return float(timings["predicted_per_token_ms"])
    finally:
        proc.terminate()
        proc.wait(30)


def summarize(ms: dict[str, list[float]], base: str, llama_base: str | None) -> list[tuple]:
    """(name, median ms, min ms, max ms, ratios to ``base`` per repetition, ratios to ``llama_base``)."""
    rows = []
    for name, values in ms.items():
        to_base = [v / b for v, b in zip(values, ms[base], strict=True)]
        to_llama = None
        if llama_base is not None and name.startswith("llama.cpp"):
            to_llama = [v / b for v, b in zip(values, ms[llama_base], strict=True)]
        rows.append((name, statistics.median(values), min(values), max(values), to_base, to_llama))
    return rows


def _spread(rs: list[float] | None) -> str:
    return "" if rs is None else f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"


def print_table(rows: list[tuple], base: str) -> None:
    width = max(len(r[0]) for r in rows) + 2
    print(f"\n{'':<{width}}{'ms/token':>10}{'min-max':>16}   {'vs ' + base:<38}vs llama.cpp first type")
    for name, med, lo, hi, to_base, to_llama in rows:
        span = f"{lo:.2f}-{hi:.2f}"
        print(f"{name:<{width}}{med:>10.2f}{span:>16}   {_spread(to_base):<38}{_spread(to_llama)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=3072)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512, help="KVFleet's prefill chunk (tokens)")
    ap.add_argument("--cpus", default=None, help="CPUs for both engines, e.g. 0,1 (default: all allowed)")
    ap.add_argument("--threads", type=int, default=1, help="llama.cpp's compute threads (KVFleet: @N)")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, metavar="SPEC")
    ap.add_argument("--llama-cache-types", nargs="*", default=["f16", "q8_0"], metavar="TYPE")
    args = ap.parse_args()
    cpus = _cpus(args.cpus)
    os.sched_setaffinity(0, cpus)
    binary = llama_server_binary() if args.llama_cache_types else None
    if binary is None and args.llama_cache_types:
        print("llama-server not found (scripts/llama_server.sh, make llama-server); KVFleet alone")
    gguf = resolve_model_path("smollm2")
    profile = ["--batch", "1", "--context", str(args.context), "--steps", str(args.steps)]
    profile += ["--chunk", str(args.chunk), "--variants", *args.variants]
    print(
        f"CPUs {sorted(cpus)}; KVFleet {args.variants}; llama.cpp {args.llama_cache_types} -t {args.threads}"
    )
    print(f"context {args.context}, {args.steps} decode steps, {gguf.name}")
    print(f"start {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.1f}")
    ms: dict[str, list[float]] = defaultdict(list)
    for rep in range(args.reps):
        sides = ["kvfleet", "llama"] if rep % 2 == 0 else ["llama", "kvfleet"]
        for side in sides:
            if side == "kvfleet":
                for spec, value in run_profile(REPO, profile).items():
                    ms[spec].append(value)
            elif binary is not None:
                types = args.llama_cache_types if rep % 2 == 0 else args.llama_cache_types[::-1]
                for cache_type in types:
                    value = llama_itl(binary, gguf, cache_type, args.context, args.steps, args.threads)
                    ms[f"llama.cpp {cache_type} KV"].append(value)
        load = os.getloadavg()
        values = ", ".join(f"{name} {v[-1]:.2f}" for name, v in ms.items())
        print(
            f"repetition {rep}: load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; ms/token {values}", flush=True
        )
    print(f"end {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.1f}")
    order = [*args.variants, *(f"llama.cpp {t} KV" for t in args.llama_cache_types if binary is not None)]
    llama_base = f"llama.cpp {args.llama_cache_types[0]} KV" if binary is not None else None
    print_table(summarize({k: ms[k] for k in order}, args.variants[0], llama_base), args.variants[0])


if __name__ == "__main__":
    main()
