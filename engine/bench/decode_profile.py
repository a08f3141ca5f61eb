"""Where a decode step's time goes, and decode-step variants timed against each other in the same run.

``python -m engine.bench.decode_profile [--batch 4] [--context 512] [--steps 12] [--variants ...]``

1. Breakdown: the real model (SmolLM2-135M GGUF) on the torch attention backend, ``--batch`` sequences of
   ``--context`` tokens in a shuffled paged pool, decoded one token per step. Each part of a scheduler decode
   step is timed on its own (building the ``ForwardBatch`` with ``for_decode``, the forward pass, greedy
   sampling, streaming detokenization), and torch.profiler splits the forward pass by operator into weight
   matmuls (``aten::mm``/``addmm``/``linear``), K/V gathers (``index_select``), attention (SDPA), K/V writes
   (``index_put_``) and the rest (norms, RoPE, activations, per-op dispatch).
2. Variants (``--variants float32@2 bfloat16@2 float32+int8wo@2 float32@1 float32@1:python``): dtype,
   ``--torchao-config`` quantization, torch thread count, decode path (``:python``: without the fused C++
   decode step, ``engine/model/fused_decode.py``; ``:torch-quant``: torch's int8/int4 kernels instead of the
   VNNI ones, ``engine/model/linear.py``) and KV cache dtype (``:kv=int8``, ``:kv=fp8_e4m3``, ...: the
   pool stores K/V as ``--kv-cache-dtype`` would, attention reads it quantized) per variant, interleaved
   rounds, wall ms per decode step (the median of a round) and the ratio to the first variant of the same
   round (median and min-max over rounds), with this process's CPU ms next to it. The context is prefilled
   once per model in ``--chunk``-token chunks (default 512) through the extend path, copied into each
   variant's KV format, and rewound before every round, so only decode steps are timed.

The breakdown's times are this process's CPU time (``time.process_time``, all threads): on a shared machine
other jobs stretch wall time but not the CPU a step consumes.

HTTP/SSE cost is not here: ``engine.bench.serve_profile`` samples a loaded server's threads for it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import NamedTuple

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.cache.kv_dtypes import KV_CACHE_DTYPES
from engine.model.forward_batch import ForwardBatch
from engine.model.loader import load_checkpoint
from engine.model.runner import ModelRunner
from engine.scheduler.sampler import sample
from engine.scheduler.sampling_params import SamplingParams

CATEGORIES = {
    "weight matmuls": (
        "aten::mm",
        "aten::addmm",
        "aten::linear",
        "aten::matmul",
    ),
    "K/V gathers": ("aten::index_select",),
    "attention (SDPA)": (
        "aten::_scaled_dot_product",
        "aten::scaled_dot_product",
        "aten::bmm",
        "aten::baddbmm",
    ),
    "K/V writes": ("aten::index_put", "aten::_index_put"),
}


class DecodeSetup:
    """``batch`` sequences of ``context`` random tokens prefilled into a pool with shuffled slots.

    Each sequence is prefilled in chunks of at most ``chunk`` tokens through the extend path (each chunk
    attends to the cached prefix, as the scheduler's chunked prefill runs a long prompt), so a long context
    never builds a context x context attention matrix in one pass. ``rewind`` returns to the prefilled
    state and ``with_kv`` copies it into a pool of another KV format, so a long context is prefilled once
    per model, not once per variant and round (a 3k-token context takes about 30 s of CPU on the AVX2 dev
    VM in bfloat16 + int4wo-32, its weight matmuls more than its attention)."""

    def __init__(
        self,
        runner: ModelRunner,
        batch: int,
        context: int,
        steps: int,
        seed: int = 0,
        kv: str = "auto",
        chunk: int = 512,
        prefill: bool = True,
    ) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        gen = torch.Generator().manual_seed(seed)
        self.runner = runner
        self.context = context
        total = batch * (context + steps + 1)
        self.pool = DeviceKVPool(-(-total // 16) * 16, 16, **vars(runner.kv_pool_spec()), kv_cache_dtype=kv)
        free = torch.randperm(total, generator=gen) + 16
        self.slots = [free[i * (context + steps + 1) : (i + 1) * (context + steps + 1)] for i in range(batch)]
        vocab = runner.config.vocab_size
        self.ids = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
        self.lens = [context] * batch
        for i in range(batch if prefill else 0):  # one sequence at a time, chunk by chunk
            for start in range(0, context, chunk):
                end = min(start + chunk, context)
                batch_i = ForwardBatch.from_sequences([self.ids[i][start:end]], [self.slots[i][:end]])
                logits = runner.forward(batch_i, self.pool)
            self.ids[i].append(int(logits.argmax(-1)))

    def rewind(self) -> None:
        """Back to the prefilled context (the decoded tokens' slots are written over by the next steps)."""
        self.ids = [ids[: self.context + 1] for ids in self.ids]
        self.lens = [self.context] * len(self.lens)

    def with_kv(self, kv: str) -> DecodeSetup:
        """The same sequences (rewound) over a pool of ``kv`` format holding this pool's K/V re-encoded
        (what a ``kv`` cache stores for them, up to the small drift of prefilling through it)."""
        steps = self.slots[0].shape[0] - self.context - 1
        other = DecodeSetup(self.runner, len(self.ids), self.context, steps, kv=kv, prefill=False)
        other.slots = [s.clone() for s in self.slots]
        other.ids = [ids[: self.context + 1] for ids in self.ids]
        rows = self.pool.decode(self.pool.kv_buffer, torch.float32)
        other.pool.kv_buffer.copy_(other.pool.kv_format.encode(rows))
        return other

    def build(self) -> ForwardBatch:
        return ForwardBatch.for_decode(
            [ids[-1] for ids in self.ids], [s[: n + 1] for s, n in zip(self.slots, self.lens, strict=True)]
        )

    def step(self) -> None:
        logits = self.runner.forward(self.build(), self.pool)
        for i, tok in enumerate(logits.argmax(-1).tolist()):
            self.ids[i].append(tok)
            self.lens[i] += 1


def breakdown(runner: ModelRunner, batch: int, context: int, steps: int, chunk: int = 512) -> None:
    setup = DecodeSetup(runner, batch, context, steps + 4, chunk=chunk)
    setup.step()  # warm-up
    times: dict[str, list[float]] = defaultdict(list)
    params = [SamplingParams()] * batch
    detoks = [runner.tokenizer.detokenizer() for _ in range(batch)]
    for _ in range(steps):
        t0 = time.process_time()
        fb = setup.build()
        t1 = time.process_time()
        logits = runner.forward(fb, setup.pool)
        t2 = time.process_time()
        toks = sample(logits, params, [None] * batch)
        t3 = time.process_time()
        for d, tok in zip(detoks, toks, strict=True):
            d.step(tok)
        t4 = time.process_time()
        for i, tok in enumerate(toks):
            setup.ids[i].append(tok)
            setup.lens[i] += 1
        for name, dt in (("build ForwardBatch", t1 - t0), ("forward", t2 - t1), ("sample", t3 - t2)):
            times[name].append(dt)
        times["detokenize"].append(t4 - t3)
    total = sum(statistics.median(v) for v in times.values())
    print(
        f"\ndecode step, batch {batch}, context {context}, dtype {runner.dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'part':<22}{'CPU ms':>10}{'share':>8}")
    for name, v in times.items():
        m = statistics.median(v)
        print(f"{name:<22}{m * 1e3:>10.2f}{m / total:>8.1%}")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            setup.step()
    cats: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        cat = next((c for c, prefixes in CATEGORIES.items() if ev.key.startswith(prefixes)), None)
        if cat is not None:
            cats[cat] += ev.self_cpu_time_total
    whole = sum(e.self_cpu_time_total for e in prof.key_averages())
    cats["other ops + dispatch"] = whole - sum(cats.values())
    print("\nforward by operator (torch.profiler self CPU time over 4 steps)")
    for name, us in sorted(cats.items(), key=lambda kv: -kv[1]):
        print(f"{name:<22}{us / 4e3:>10.2f} ms/step{us / whole:>8.1%}")


class Variant(NamedTuple):
    dtype: str
    quantization: str | None
    threads: int
    fused: bool
    quant_kernels: bool
    kv: str


def _parse_variant(spec: str) -> Variant:
    """``dtype[+quantization][@threads][:python][:torch-quant][:kv=KV_DTYPE]``, e.g. ``float32``,
    ``bfloat16@1``, ``float32+int8wo@2``, ``bfloat16+int4wo-32@1:python``, ``bfloat16@2:kv=int8``
    (``:python``: the Python decode path, no fused C++ step; ``:torch-quant``: torch's weight-only kernels,
    ``--disable-cpu-quant-kernels``; ``:kv=``: the ``--kv-cache-dtype``, default ``auto``)."""
    spec, *suffixes = spec.split(":")
    kvs = [s.removeprefix("kv=") for s in suffixes if s.startswith("kv=")]
    paths = [s for s in suffixes if not s.startswith("kv=")]
    unknown = set(paths) - {"python", "torch-quant"}
    if unknown or len(kvs) > 1:
        raise SystemExit(
            f"--variants: unknown suffix {sorted(unknown) or kvs} "
            "(only ':python', ':torch-quant', one ':kv=')"
        )
    if kvs and kvs[0] not in KV_CACHE_DTYPES:
        raise SystemExit(f"--variants: ':kv={kvs[0]}' is not a --kv-cache-dtype (one of {KV_CACHE_DTYPES})")
    rest, _, threads = spec.partition("@")
    dtype, _, quant = rest.partition("+")
    threads_n = int(threads or torch.get_num_threads())
    kv = kvs[0] if kvs else "auto"
    return Variant(dtype, quant or None, threads_n, "python" not in paths, "torch-quant" not in paths, kv)


def _runner_key(v: Variant) -> tuple:
    return (v.dtype, v.quantization, v.fused, v.quant_kernels)


def setups(runners: dict, configs: list[Variant], batch: int, context: int, steps: int, chunk: int) -> list:
    """One ``DecodeSetup`` per variant: the first variant of each model prefills its context (in chunks),
    the others with the same model take a copy of it in their KV format (``DecodeSetup.with_kv``)."""
    prefilled: dict[tuple, DecodeSetup] = {}
    out = []
    for v in configs:
        torch.set_num_threads(v.threads)
        first = prefilled.get(_runner_key(v))
        if first is None:
            t0 = time.perf_counter()
            first = DecodeSetup(runners[_runner_key(v)], batch, context, steps, kv=v.kv, chunk=chunk)
            prefilled[_runner_key(v)] = first
            print(
                f"prefilled {batch} x {context} tokens in chunks of {chunk}: {time.perf_counter() - t0:.1f} s"
            )
            out.append(first)
        else:
            out.append(first.with_kv(v.kv))
    return out


def variants(
    ckpt, batch: int, context: int, steps: int, rounds: int, specs: list[str], chunk: int = 512
) -> None:
    """Each variant decodes ``steps`` steps per round from the same prefilled context (rewound every
    round); rounds alternate the order. Wall ms per step (the median of a round) and its ratio to the first
    variant of the same round, median (min-max) over rounds."""
    configs = [_parse_variant(s) for s in specs]
    try:
        runners = {
            _runner_key(v): ModelRunner.from_checkpoint(
                ckpt,
                dtype=v.dtype,
                quantization=v.quantization,
                fused_decode=v.fused,
                cpu_quant_kernels=v.quant_kernels,
            )
            for v in configs
        }
    except ValueError as exc:  # a QuantizationError or an unknown dtype: say which, no traceback
        raise SystemExit(f"--variants: {exc}") from None
    wall: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    ratios: dict[str, list[float]] = defaultdict(list)
    threads_before = torch.get_num_threads()
    prepared = setups(runners, configs, batch, context, steps + 2, chunk)
    for r in range(rounds):
        order = list(zip(specs, configs, prepared, strict=True))
        this_round = {}
        for spec, v, setup in order if r % 2 == 0 else order[::-1]:
            torch.set_num_threads(v.threads)
            setup.rewind()
            setup.step()
            ts, cs = [], []
            for _ in range(steps):
                t0, c0 = time.perf_counter(), time.process_time()
                setup.step()
                ts.append(time.perf_counter() - t0)
                cs.append(time.process_time() - c0)
            this_round[spec] = statistics.median(ts)
            wall[spec].append(this_round[spec])
            cpu[spec].append(statistics.median(cs))
        for spec, v in this_round.items():
            ratios[spec].append(v / this_round[specs[0]])
    torch.set_num_threads(threads_before)
    print(f"\nvariants, batch {batch}, context {context}, {rounds} interleaved rounds of {steps} steps")
    width = max(22, *(len(s) + 2 for s in specs))
    print(f"{'variant':<{width}}{'wall ms/step':>14}{'CPU ms/step':>13}   vs {specs[0]} (median, min-max)")
    for spec in specs:
        rs, w, c = ratios[spec], statistics.median(wall[spec]), statistics.median(cpu[spec])
        spread = f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"
        print(f"{spec:<{width}}{w * 1e3:>14.1f}{c * 1e3:>13.1f}   {spread}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="smollm2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--chunk",
        type=int,
        default=512,
        help="prefill the context in chunks of this many tokens (default 512)",
    )
    ap.add_argument(
        "--variants",
        nargs="*",
        metavar="DTYPE[+QUANT][@THREADS][:python][:torch-quant][:kv=KV_DTYPE]",
        help="also time these against the first (e.g. float32@2 bfloat16@2 float32+int8wo@2 float32@1; "
        "':python' decodes without the fused C++ step, ':torch-quant' with torch's weight-only kernels, "
        "':kv=int8' with an int8 KV cache)",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-breakdown", action="store_true", help="only the variants")
    args = ap.parse_args()
    torch.set_num_threads(2)
    ckpt = load_checkpoint(args.model_path)
    if not args.no_breakdown:
        runner = ModelRunner.from_checkpoint(ckpt, dtype=args.dtype)
        breakdown(runner, args.batch, args.context, args.steps, args.chunk)
    if args.variants:
        variants(ckpt, args.batch, args.context, args.steps, args.rounds, args.variants, args.chunk)


if __name__ == "__main__":
    main()
