"""Where a streamed token's time goes in the running server: a sampling profile of its threads under load.

``python -m engine.bench.serve_profile [--clients 4] [--requests 8] [--max-tokens 48] [-- LAUNCH FLAGS]``

The engine runs in this process (``build_engine`` + uvicorn on a free port: the objects
``engine.launch_server`` builds; flags after ``--`` are its launch flags, default ``--model-path smollm2
--enable-hierarchical-cache``); the client runs in a child process (the bounded streaming client of
``engine.bench.peers`` on the shared-prefix workload, ``/v1/completions`` with ``stream``), so it takes no GIL
here. While the client runs, a sampler thread reads the Python stacks of the scheduler thread and of the
HTTP (event loop) thread (``sys._current_frames``) every ``--interval`` ms, as py-spy does from outside
(py-spy is not installed here), and files each sample under one part by the functions on its stack:

- scheduler: the forward pass, split into layer weight matmuls (dense or weight-only linear layers), the LM
  head matmul, attention (K/V write, gather, SDPA: the attention backend), the per-layer cache hook, and the
  rest of a layer (norms, RoPE, residual adds, SiLU, embedding), or the fused decode step as one part (one
  C++ call, which Python stacks do not split: ``engine.bench.decode_profile`` does); building the decode
  ``ForwardBatch``; sampling; per-request Python after sampling (token bookkeeping, stop checks, event
  hand-off); the state snapshot published after every iteration; cache events; prefill passes; waiting for
  work.
- HTTP thread: detokenization (``StreamText.push``), SSE framing (``sse``: ``json.dumps`` of a chunk), the
  rest of uvicorn/starlette/asyncio and the route handlers, and idle (the event loop in ``select``).

Sampling starts with the first busy sample of the scheduler (the client process starts meanwhile) and
ends with the client. Shares are of wall-clock samples. torch ops release the GIL while they compute, so the
sampler sees the scheduler inside them; a thread running pure Python holds the GIL for up to the switch
interval (5 ms), which can delay a sample but not misfile it. Also printed: each thread's CPU seconds over
the sampled run (``pthread_getcpuclockid``; the scheduler's OpenMP worker threads are not in it) and per
streamed token.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time

import uvicorn

from engine.ports import free_port
from engine.server.app import create_app
from engine.server.args import parse_args
from engine.server.builder import build_engine

DEFAULT_FLAGS = ["--model-path", "smollm2", "--enable-hierarchical-cache"]
IDLE = "waiting for work (inbox)"
LINEAR = ("DenseLinear.__call__", "_WeightOnlyLinear.__call__")  # dense, int8wo and int4wo layers
CLIENT = (
    "import asyncio, json, sys\n"
    "from engine.bench.peers import drive, prompts\n"
    "url, clients, n, max_tokens, words = sys.argv[1], *map(int, sys.argv[2:])\n"
    "texts = prompts('shared-prefix', n, words, seed=0)\n"
    "print(json.dumps(asyncio.run(drive(url, texts, clients, max_tokens))))\n"
)


def stack_names(frame) -> list[str]:
    """Qualified function names on the stack of ``frame``, outermost first."""
    names = []
    while frame is not None:
        names.append(frame.f_code.co_qualname)
        frame = frame.f_back
    return names[::-1]


def scheduler_part(names: list[str]) -> str:
    """The part of a scheduler iteration that a stack (qualified names, outermost first) is in."""
    if "Scheduler._drain_inbox" in names:
        return IDLE
    if "Scheduler._run_prefill" in names:
        return "prefill pass"
    if "Scheduler._publish" in names:
        return "state snapshot (_publish)"
    if "HiRadixCache.check_hicache_events" in names:
        return "cache events"
    if "Scheduler._run_decode" not in names:
        return "loop other"
    if "ForwardBatch.for_decode" in names:
        return "decode: build ForwardBatch"
    if "BatchSampler.sample" in names:
        return "decode: sampling"
    if "Scheduler._forward" not in names:
        return "decode: per-request Python (append, stop checks, events)"
    if "FusedDecodeStep.__call__" in names:  # one C++ call: its parts are in decode_profile's breakdown
        return "forward: fused decode step (C++)"
    if any(n in LINEAR for n in names):
        return (
            "forward: layer weight matmuls" if "DecoderLayer.forward" in names else "forward: LM head matmul"
        )
    if any(n.endswith("AttentionBackend.forward") or n.endswith("init_forward_metadata") for n in names):
        return "forward: attention (K/V write, gather, SDPA)"
    if any(n.endswith("wait_layer") for n in names):
        return "forward: cache layer hook"
    return "forward: norms, RoPE, adds, SiLU, embedding"


def http_part(names: list[str]) -> str:
    """The part of the HTTP thread's work that a stack is in."""
    if "StreamText.push" in names:
        return "detokenize (StreamText.push)"
    if "sse" in names:
        return "SSE framing (sse / json.dumps)"
    if names and names[-1].endswith("Selector.select"):
        return "idle (event loop select)"
    return "HTTP: uvicorn/starlette/asyncio/handlers"


class Sampler(threading.Thread):
    """Counts, every ``interval`` s, which part each watched thread is in."""

    def __init__(self, threads: dict[str, tuple[threading.Thread, object]], interval: float) -> None:
        super().__init__(name="sampler", daemon=True)
        self.watched = threads
        self.interval = interval
        self.counts: dict[str, collections.Counter] = {name: collections.Counter() for name in threads}
        self.cpu0 = {name: _cpu(t) for name, (t, _) in threads.items()}
        self.cpu: dict[str, float] = {}
        self.done = threading.Event()
        self.started_at: float | None = None  # the first sample with the scheduler busy

    def run(self) -> None:
        while not self.done.wait(self.interval):
            frames = sys._current_frames()
            parts = {}
            for name, (thread, classify) in self.watched.items():
                frame = frames.get(thread.ident)
                if frame is not None:
                    parts[name] = classify(stack_names(frame))
            if self.started_at is None:  # the client process is still starting (it imports torch)
                if parts.get("scheduler", IDLE) == IDLE:
                    continue
                self.started_at = time.perf_counter()
                self.cpu0 = {name: _cpu(t) for name, (t, _) in self.watched.items()}
            for name, part in parts.items():
                self.counts[name][part] += 1
        self.cpu = {name: _cpu(t) - self.cpu0[name] for name, (t, _) in self.watched.items()}


def _cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def main() -> None:
    argv = sys.argv[1:]
    launch = argv[argv.index("--") + 1 :] if "--" in argv else DEFAULT_FLAGS
    ours = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prefix-words", type=int, default=200)
    ap.add_argument("--interval", type=float, default=2.0, help="ms between samples")
    args = ap.parse_args(ours)
    port = free_port()
    engine = build_engine(parse_args([*launch, "--port", str(port), "--log-level", "warning"]))
    config = uvicorn.Config(create_app(engine), port=port, log_level="warning", loop="asyncio")
    server = uvicorn.Server(config)
    http = threading.Thread(target=server.run, name="http", daemon=True)
    http.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"

    def client(n: int) -> list[str]:
        return [
            sys.executable,
            "-c",
            CLIENT,
            url,
            *map(str, (args.clients, n, args.max_tokens, args.prefix_words)),
        ]

    subprocess.run(client(2), check=True, capture_output=True)  # warm-up
    sched = next(t for t in threading.enumerate() if t.name == "scheduler")
    watched = {"scheduler": (sched, scheduler_part), "http": (http, http_part)}
    sampler = Sampler(watched, args.interval / 1e3)
    sampler.start()
    out = subprocess.run(client(args.requests), check=True, capture_output=True, text=True).stdout
    sampler.done.set()
    sampler.join()
    wall = time.perf_counter() - sampler.started_at
    server.should_exit = True
    http.join(10)
    engine.scheduler.stop()
    result = json.loads(out)
    tokens = args.requests * args.max_tokens
    print(
        f"\n{' '.join(launch)}; {args.clients} clients, {args.requests} requests x {args.max_tokens} tokens"
    )
    print(f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}, load {os.getloadavg()[0]:.1f}")
    itl_ms = result["itl"] * 1e3
    print(f"client: TTFT {result['ttft']:.3f} s, median ITL {itl_ms:.1f} ms, {result['rps']:.2f} req/s")
    for name, counts in sampler.counts.items():
        total = sum(counts.values())
        cpu = sampler.cpu[name]
        per_token = cpu / tokens * 1e3
        print(
            f"\n{name} thread: {total} samples over {wall:.1f} s; CPU {cpu:.2f} s ({per_token:.2f} ms/token)"
        )
        for part, n in counts.most_common():
            print(f"  {part:<58}{n / total:>7.1%}")


if __name__ == "__main__":
    main()
