"""Drift of lower-precision modes against float32: top-1 agreement over a fixed prompt set.

``python -m engine.bench.drift [--variants bfloat16 bfloat16+int8wo float32@int8 bfloat16@fp8_e4m3]``

A variant is ``dtype[+quantization][:torch-quant][@kv-cache-dtype]``: ``@int8`` / ``@fp8_e4m3`` / ...
stores its KV cache in that ``--kv-cache-dtype``. Besides agreement, the logit error is printed: the mean
over positions of max |logit - fp32 logit| / max |fp32 logit|.

For each of the fixed chat prompts below, float32 greedily answers ``--new-tokens`` tokens (the reference).
Each variant (``dtype[+quantization][:torch-quant]``; ``:torch-quant`` = torch's weight-only kernels,
``--disable-cpu-quant-kernels``) then runs over prompt + reference answer (teacher forcing) the way a server
does: the prompt in one prefill, then the answer one decode step per token, so decode steps run the decode
kernels. We count the positions (the last prompt token and every answer token but the last) where its top-1
equals float32's, plus where it is in float32's top-5. Also: how many of the prompts the variant answers with
the identical greedy tokens when it decodes on its own (once two runs differ, they follow different contexts).

``auto`` is what a worker's ``--dtype auto`` computes with (``engine/model/compute_mode.py``). ``llama.cpp``
is llama.cpp's ``llama-server`` on the same GGUF (found as ``engine.bench.peers`` finds it; ``make
llama-server``), as the GGUF's own runtime: the same token ids go in, its greedy next token at each position
comes from ``/completion`` (``n_predict`` 1, prompt cache on), its 32-token answer from one greedy request
(``ignore_eos``); it returns no logits, so its logit error is not printed.
"""

from __future__ import annotations

import argparse

import httpx
import torch

from engine.bench.peers import LlamaServer, llama_server_binary
from engine.cache.device_pool import DeviceKVPool
from engine.model.forward_batch import ForwardBatch
from engine.model.loader import load_checkpoint, resolve_model_path
from engine.model.runner import ModelRunner

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "Give me a short recipe for pancakes.",
    "What is the difference between TCP and UDP?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What does a CPU cache do?",
    "Suggest a name for a small grey cat.",
)


def _logits(runner: ModelRunner, prompt: list[int], answer: list[int], kv: str = "auto") -> torch.Tensor:
    """Float32 logits ``(len(answer), vocab)``: after ``prompt`` (one prefill into a fresh pool whose KV is
    stored as ``kv``), then after each answer token but the last (one decode step each)."""
    size = -(-(len(prompt) + len(answer)) // 16) * 16
    pool = DeviceKVPool(size, 16, **vars(runner.kv_pool_spec()), kv_cache_dtype=kv)
    slots = torch.arange(16, 16 + len(prompt) + len(answer))
    out = [runner.forward(ForwardBatch.from_sequences([prompt], [slots[: len(prompt)]]), pool)]
    for i, token in enumerate(answer[:-1]):
        n = len(prompt) + i + 1
        out.append(runner.forward(ForwardBatch.for_decode([token], [slots[:n]]), pool))
    return torch.cat(out)


def greedy(runner: ModelRunner, prompt: list[int], new_tokens: int, kv: str = "auto") -> list[int]:
    """``new_tokens`` greedy tokens after ``prompt`` (prefill once, then one decode step per token)."""
    size = -(-(len(prompt) + new_tokens) // 16) * 16
    pool = DeviceKVPool(size, 16, **vars(runner.kv_pool_spec()), kv_cache_dtype=kv)
    slots = torch.arange(16, 16 + len(prompt) + new_tokens)
    logits = runner.forward(ForwardBatch.from_sequences([prompt], [slots[: len(prompt)]]), pool)
    out = [int(logits.argmax(-1))]
    while len(out) < new_tokens:
        n = len(prompt) + len(out)
        logits = runner.forward(ForwardBatch.from_sequences([[out[-1]]], [slots[:n]]), pool)
        out.append(int(logits.argmax(-1)))
    return out


def _llama_next(url: str, tokens: list[int], n: int) -> list[int]:
    """llama-server's ``n`` greedy tokens after ``tokens`` (ids in, ids out; EOS ignored)."""
    body = {"prompt": tokens, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True}
    body |= {"cache_prompt": True, "return_tokens": True, "samplers": ["top_k"]}
    resp = httpx.post(f"{url}/completion", json=body, timeout=120)
    resp.raise_for_status()
    return [int(t) for t in resp.json()["tokens"]]


def _llama_row(model_path: str, prompts: list[list[int]], refs: list[list[int]], ref_logits: list) -> str:
    """The ``llama.cpp`` variant's table row (its greedy top-1 at every position against float32's)."""
    binary = llama_server_binary()
    if binary is None:
        return f"{'llama.cpp':<22}  skipped: no llama-server (make llama-server)"
    server = LlamaServer(binary, resolve_model_path(model_path), threads=torch.get_num_threads(), parallel=1)
    try:
        same = top5 = identical = 0
        for p, r, ref in zip(prompts, refs, ref_logits, strict=True):
            got = torch.tensor([_llama_next(server.url, p + r[:i], 1)[0] for i in range(len(r))])
            same += int((got == ref.argmax(-1)).sum())
            top5 += int((ref.topk(5, dim=-1).indices == got[:, None]).any(-1).sum())
            identical += _llama_next(server.url, p, len(r)) == r
    finally:
        server.close()
    positions = sum(len(r) for r in refs)
    return (
        f"{'llama.cpp':<22}{same / positions:>17.1%}{top5 / positions:>15.1%}"
        f"{f'{identical}/{len(prompts)}':>19}{'-':>13}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="smollm2")
    ap.add_argument("--variants", nargs="+", default=["bfloat16", "float32+int8wo", "bfloat16+int8wo"])
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    ckpt = load_checkpoint(args.model_path)
    ref_runner = ModelRunner.from_checkpoint(ckpt, dtype="float32")
    tok = ref_runner.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    refs = [greedy(ref_runner, p, args.new_tokens) for p in prompts]
    ref_logits = [_logits(ref_runner, p, r) for p, r in zip(prompts, refs, strict=True)]
    positions = sum(len(r) for r in refs)
    print(f"{len(prompts)} prompts x {args.new_tokens} answer tokens = {positions} positions vs float32")
    print(
        f"{'variant':<22}{'top-1 agreement':>17}{'in fp32 top-5':>15}{'identical answers':>19}"
        f"{'logit error':>13}"
    )
    for spec in args.variants:
        if spec == "llama.cpp":
            print(_llama_row(args.model_path, prompts, refs, ref_logits))
            continue
        spec_mode, _, kv = spec.partition("@")
        mode, _, suffix = spec_mode.partition(":")
        if suffix not in ("", "torch-quant"):
            raise SystemExit(f"--variants: unknown suffix {suffix!r} (only ':torch-quant')")
        dtype, _, quant = mode.partition("+")
        runner = ModelRunner.from_checkpoint(
            ckpt, dtype=dtype, quantization=quant or None, cpu_quant_kernels=suffix != "torch-quant"
        )
        kv = kv or "auto"
        same = top5 = identical = 0
        error = 0.0
        for p, r, ref in zip(prompts, refs, ref_logits, strict=True):
            logits = _logits(runner, p, r, kv)
            got = logits.argmax(-1)
            same += int((got == ref.argmax(-1)).sum())
            top5 += int((ref.topk(5, dim=-1).indices == got[:, None]).any(-1).sum())
            error += float(((logits - ref).abs().amax(-1) / ref.abs().amax(-1)).sum())
            identical += greedy(runner, p, args.new_tokens, kv) == r
        print(
            f"{spec:<22}{same / positions:>17.1%}{top5 / positions:>15.1%}"
            f"{f'{identical}/{len(prompts)}':>19}{error / positions:>13.4f}"
        )


if __name__ == "__main__":
    main()
