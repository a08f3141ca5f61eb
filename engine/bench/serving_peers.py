"""KVFleet's default mode against llama.cpp, with SGLang's ``bench_serving`` as the client.

``python -m engine.bench.serving_peers [--reps 3] [--clients 1 4] [--threads 1] [--cpus 1]
[--num-prompts 16] [--output-len 32] [--cold-lens 1024 2048 4096 8192] [--variants "" "--dtype float32"]
[--sglang-python PATH]``

Servers, one at a time, in an order rotated per repetition: llama.cpp's ``llama-server`` on the SmolLM2
Q4_1 GGUF (prompt cache on, ``-np`` = the largest ``--clients``, ``--kv-unified``, context for the longest
cold prompt on every slot) and one KVFleet worker per ``--variants`` entry (``--model-path smollm2`` plus
those flags; ``""`` = the bare default). Each server runs every workload through ``python -m
sglang.bench_serving --backend sglang-oai`` (OpenAI ``/v1/completions``, streamed, ``ignore_eos``,
``Connection: close``, the GGUF's tokenizer from its HF export (``engine.fleet.hf_export``), no warm-up
request: its prompt would be the measured run's first), from upstream SGLang's own environment
(``scripts/sglang_env.sh``; ``--sglang-python`` or ``$KVFLEET_SGLANG_PYTHON``):

* ``shared-prefix, C clients``: ``generated-shared-prefix``, one group of ``--num-prompts`` prompts sharing a
  256-token system prompt, 32-token questions, ``--output-len`` tokens out, ``--max-concurrency C``;
* ``random, C clients``: ``random-ids``, ``--num-prompts`` prompts of 256 random token ids (no reuse);
* ``cold L``: one prompt of L random token ids, 1 token out, one client: TTFT is the whole prefill.

Figures: mean TTFT, median ITL (ms) and req/s as bench_serving reports them; each KVFleet / llama.cpp ratio
is taken within one repetition and printed as the median (min-max) over repetitions. This process pins itself
(and so the servers and the client) to ``--cpus`` first; each server computes with ``--threads`` threads
(KVFleet: ``OMP_NUM_THREADS``; llama.cpp: ``-t`` / ``-tb``). The load average is printed after each
repetition. A workload that fails on a server is printed with bench_serving's output and shown as "-". Without
``llama-server`` (``make llama-server``) or the SGLang environment it exits naming them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from engine.bench.launcher import ServerProcess
from engine.bench.peers import LlamaServer, llama_server_binary
from engine.fleet.hf_export import export
from engine.model.loader import resolve_model_path

METRICS = (
    ("mean TTFT (ms)", "mean_ttft_ms"),
    ("median ITL (ms)", "median_itl_ms"),
    ("req/s", "request_throughput"),
)


def _metrics(load: str) -> tuple:
    """The figures a workload gives: a cold prompt (one token out) only its TTFT."""
    return METRICS[:1] if load.startswith("cold") else METRICS


def workloads(clients: list[int], num_prompts: int, output_len: int, cold_lens: list[int]) -> dict[str, list]:
    """Workload name -> the bench_serving arguments that run it."""
    out: dict[str, list] = {}
    for c in clients:
        out[f"shared-prefix, {c} clients"] = [
            "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "1",
            "--gsp-prompts-per-group", str(num_prompts), "--gsp-system-prompt-len", "256",
            "--gsp-question-len", "32", "--gsp-output-len", str(output_len), "--gsp-range-ratio", "1",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(c),
        ]  # fmt: skip
        out[f"random, {c} clients"] = [
            "--dataset-name", "random-ids", "--random-input-len", "256", "--random-output-len",
            str(output_len), "--random-range-ratio", "1", "--num-prompts", str(num_prompts),
            "--max-concurrency", str(c),
        ]  # fmt: skip
    for n in cold_lens:
        out[f"cold {n}"] = [
            "--dataset-name", "random-ids", "--random-input-len", str(n), "--random-output-len", "1",
            "--random-range-ratio", "1", "--num-prompts", "1", "--max-concurrency", "1",
        ]  # fmt: skip
    return out


def bench_serving(python: str, url: str, tokenizer: Path, args: list, seed: int) -> dict:
    """One ``sglang.bench_serving`` run against ``url``: its result record (``mean_ttft_ms``, ...)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.jsonl"
        cmd = [python, "-m", "sglang.bench_serving", "--backend", "sglang-oai", "--base-url", url]
        cmd += [
            "--model",
            "smollm2",
            "--tokenizer",
            str(tokenizer),
            "--warmup-requests",
            "0",
            "--seed",
            str(seed),
        ]
        # a fresh connection per request: llama-server drops a kept-alive connection after a streamed
        # response, and concurrent clients then lose every request (engine.bench.peers does the same)
        cmd += ["--header", "Connection=close", "--disable-tqdm", "--output-file", str(out), *args]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if run.returncode or not out.exists():
            raise RuntimeError(
                f"bench_serving failed ({run.returncode}):\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
            )
        record = json.loads(out.read_text().splitlines()[-1])
    if record["completed"] != int(args[args.index("--num-prompts") + 1]):
        raise RuntimeError(f"bench_serving completed {record['completed']} requests of {args}")
    return record


def _sglang_python(given: str | None) -> str:
    python = given or os.environ.get("KVFLEET_SGLANG_PYTHON")
    if not python:
        found = subprocess.run(["scripts/sglang_env.sh"], capture_output=True, text=True, check=False)
        python = found.stdout.strip().splitlines()[-1] if found.returncode == 0 and found.stdout else ""
    if not python or not os.access(python, os.X_OK):
        raise SystemExit("SGLang's environment is missing: run scripts/sglang_env.sh or pass --sglang-python")
    return python


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--cold-lens", type=int, nargs="*", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpus", default=None, help="CPUs for every server and the client, e.g. 1")
    ap.add_argument("--variants", nargs="+", default=[""], help="KVFleet launch flags per server")
    ap.add_argument("--sglang-python", default=None)
    args = ap.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    python = _sglang_python(args.sglang_python)
    binary = llama_server_binary()
    if binary is None:
        raise SystemExit("no llama-server: run make llama-server (scripts/llama_server.sh)")
    gguf = resolve_model_path("smollm2")
    tokenizer = export("smollm2")
    loads = workloads(args.clients, args.num_prompts, args.output_len, args.cold_lens)
    ctx = max([*args.cold_lens, 256 + 32 + 32]) + args.output_len + 64
    servers = ["llama.cpp", *args.variants]
    print(f"cpus {sorted(os.sched_getaffinity(0))}, {args.threads} thread(s) per server, client: {python}")
    results: dict[tuple[str, str, str], list[float]] = defaultdict(list)  # (server, workload, metric)
    ratios: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for rep in range(args.reps):
        order = servers[rep % len(servers) :] + servers[: rep % len(servers)]
        got: dict[str, dict[str, dict]] = {}
        for name in order:
            got[name] = _run_server(
                name, binary, gguf, ctx, max(args.clients), args.threads, python, loads, rep, tokenizer
            )
        for name, per_load in got.items():
            for load, record in per_load.items():
                for label, key in _metrics(load):
                    results[name, load, label].append(record[key])
                    if name != "llama.cpp" and load in got["llama.cpp"]:
                        ratios[name, load, label].append(record[key] / got["llama.cpp"][load][key])
        print(
            f"rep {rep + 1}/{args.reps} done, order {order}, load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    _print_table(servers, loads, results, ratios)


def _run_server(name, binary, gguf, ctx, parallel, threads, python, loads, rep, tokenizer) -> dict[str, dict]:
    """Start server ``name``, run every workload through bench_serving, stop it; workload -> record."""
    if name == "llama.cpp":
        server = LlamaServer(binary, gguf, threads, parallel, ctx=ctx * parallel, extra=["--kv-unified"])
        url, stop = server.url, server.close
    else:
        proc = ServerProcess(
            ["--model-path", "smollm2", *shlex.split(name)], env={"OMP_NUM_THREADS": str(threads)}
        )
        proc.__enter__()
        url, stop = proc.url, lambda: proc.__exit__(None, None, None)
    records = {}
    try:
        for load, wargs in loads.items():
            try:
                records[load] = bench_serving(python, url, tokenizer, wargs, seed=rep)
            except RuntimeError as exc:  # one failed workload: said, left out of the table, the rest run
                print(f"{name or 'KVFleet default'}, {load}: {str(exc)[-600:]}", flush=True)
    finally:
        stop()
    return records


def _print_table(servers, loads, results, ratios) -> None:
    def num(x: float) -> str:
        return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"

    def span(xs: list[float]) -> str:  # "-": no repetition measured it
        return f"{num(statistics.median(xs))} ({num(min(xs))}-{num(max(xs))})" if xs else "-"

    names = ["KVFleet " + (s or "default") if s != "llama.cpp" else s for s in servers]
    head = "| workload | metric | " + " | ".join(names)
    head += " | " + " | ".join(f"{n} / llama.cpp" for n in names[1:]) + " |"
    print(head)
    print("|---|---|" + "---:|" * (len(names) * 2 - 1))
    for load in loads:
        for label, _ in _metrics(load):
            cells = [span(results[s, load, label]) for s in servers]
            cells += [f"**{span(ratios[s, load, label])}**" for s in servers[1:]]
            print(f"| {load} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
