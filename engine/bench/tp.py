"""Tensor-parallel overhead on the tiny model: all-reduce time per layer and decode step time, tp 2 vs tp 1.

``python -m engine.bench.tp [--tp 2] [--batch 4] [--context 64] [--steps 30] [--device cpu|cuda]``

Writes a random-weight Llama (transformers; 8 query heads, 4 KV heads, hidden 256, 4 layers, vocab 4096) to a
temporary folder, then runs the same greedy decode at tp 1 and at ``--tp`` (one spawned process per rank,
gloo on the CPU, NCCL on CUDA with ``--base-gpu-id`` 0..tp-1) in the same run. Per configuration: the median
decode step (wall ms, rank 0), the all-reduce calls per step and their median time each, and the share of the
step they take; then the step-time ratio tp / tp 1. On a CPU the ranks share the cores (torch threads = cores
/ tp), so tp buys no speed here: this measures what the collectives cost, honestly. Every configuration also
checks that its greedy tokens equal tp 1's (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.ports import free_port


def write_model(folder: Path) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=1024,
        initializer_range=0.2,
    )
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    # a tokenizer the loader accepts: a trivial word-level one over the vocabulary
    import tokenizers

    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "t1"}')


def rank(r: int, size: int, folder: str, method: str, device: str, opts: dict, out) -> None:
    from engine.cache.device_pool import DeviceKVPool
    from engine.distributed import init_tp_group
    from engine.model.forward_batch import ForwardBatch
    from engine.model.runner import ModelRunner

    if device == "cuda":
        torch.cuda.set_device(r)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    group = init_tp_group(r, size, method, device)
    times: list[float] = []
    real = group.all_reduce

    def timed(x: torch.Tensor) -> torch.Tensor:
        sync(device)
        t0 = time.perf_counter()
        y = real(x)
        sync(device)
        times.append(time.perf_counter() - t0)
        return y

    group.all_reduce = timed  # type: ignore[method-assign]
    runner = ModelRunner(folder, device=device, tp=group, fused_decode=False)
    batch, context = opts["batch"], opts["context"]
    pool = DeviceKVPool(batch * (context + opts["steps"] + 8), 1, **vars(runner.kv_pool_spec()))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 4096, (context,), generator=gen).tolist() for _ in range(batch)]
    slots = [
        torch.arange(1 + i * (context + opts["steps"] + 4), 1 + (i + 1) * (context + opts["steps"] + 4))
        for i in range(batch)
    ]
    logits = runner.forward(
        ForwardBatch.from_sequences(prompts, [s[:context] for s in slots], device=device), pool
    )
    last = logits.argmax(-1).tolist()
    tokens, steps, reduces = [last], [], []
    for i in range(opts["steps"]):
        n = context + i + 1
        times.clear()
        sync(device)
        t0 = time.perf_counter()
        b = ForwardBatch.for_decode(last, [s[:n] for s in slots], None, device)
        last = runner.forward(b, pool).argmax(-1).tolist()
        sync(device)
        steps.append(time.perf_counter() - t0)
        reduces.append(list(times))
        tokens.append(last)
    if r == 0:
        per_call = [t for step in reduces[3:] for t in step]
        out.put(
            {
                "step_ms": statistics.median(steps[3:]) * 1e3,
                "reduce_calls": len(reduces[-1]),
                "reduce_us": statistics.median(per_call) * 1e6 if per_call else 0.0,
                "reduce_ms_per_step": statistics.median(sum(s) for s in reduces[3:]) * 1e3,
                "layers": runner.config.num_hidden_layers,
                "tokens": tokens,
            }
        )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(size: int, folder: Path, device: str, opts: dict) -> dict:
    method = f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=rank, args=(r, size, str(folder), method, device, opts, out)) for r in range(size)
    ]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = p.parse_args(argv)
    if a.device == "cuda" and torch.cuda.device_count() < a.tp:
        print(f"tp {a.tp} on cuda: not measured ({torch.cuda.device_count()} GPUs visible)")
        return 0
    opts = {"batch": a.batch, "context": a.context, "steps": a.steps}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_model(folder)
        base = run(1, folder, a.device, opts)
        other = run(a.tp, folder, a.device, opts)
    cores = os.cpu_count()
    shape = f"batch {a.batch}, context {a.context}, {a.device}, {cores} cores"
    print(f"tiny Llama (4 layers, hidden 256), {shape}")
    for name, res in (("tp 1", base), (f"tp {a.tp}", other)):
        share = res["reduce_ms_per_step"] / res["step_ms"] if res["step_ms"] else 0
        print(
            f"{name}: decode step {res['step_ms']:.2f} ms; all-reduce {res['reduce_calls']} calls/step "
            f"({res['reduce_calls'] / res['layers']:.1f} per layer), {res['reduce_us']:.0f} us each, "
            f"{res['reduce_ms_per_step']:.2f} ms/step ({share:.0%} of the step)"
        )
    print(f"step time tp {a.tp} / tp 1: {other['step_ms'] / base['step_ms']:.2f}x")
    if other["tokens"] != base["tokens"]:
        print(f"FAIL: greedy tokens at tp {a.tp} differ from tp 1")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
