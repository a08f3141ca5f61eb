"""MLA (DeepSeek) KV bytes against GQA, and decode attention: absorbed latent vs expanded keys and values.

``python -m engine.bench.mla [--heads 16] [--context 1024] [--batch 2] [--steps 10] [--device cpu|cuda]
[--threads N]``

1. KV bytes per token and tokens per GiB of L1 / L2 (``engine/sizing/kv.py``, bfloat16) for DeepSeek-V3's
   attention shape (61 layers, latent ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64) against a GQA model of
   the same hidden size (7168; 61 layers, 8 KV heads of 128 as Llama-style models of that size use), and for
   the tests' tiny pair (2 layers, latent 32 + 16 vs 2 KV heads of 16, hidden 64).
2. One layer's decode attention (``engine/model/attention/mla.py``) over a cached latent of ``--context``
   tokens per sequence at DeepSeek-V3's per-head sizes (``kv_lora_rank`` 512, rope 64, nope 128, v 128) and
   ``--heads`` heads: expanding the latent through ``kv_b_proj`` for every cached token and head (the prefill
   path) against attending in the latent space with the absorbed ``W_UK`` / ``W_UV`` (the decode path), in
   the same run; prints the median times, their ratio and the largest difference of the two outputs
   (exit 1 above 1e-3 of the output's magnitude).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from engine.cache.device_pool import DeviceKVPool
from engine.model.attention.mla import MLAAttention
from engine.model.forward_batch import ForwardBatch
from engine.sizing.kv import shape_for

GIB = 1024**3


def kv_table() -> list[str]:
    rows = [
        ("DeepSeek-V3 MLA (61 layers, latent 512 + 64)", shape_for(61, 1, (512 + 64) // 2, "bfloat16")),
        ("GQA, hidden 7168 (61 layers, 8 KV heads x 128)", shape_for(61, 8, 128, "bfloat16")),
        ("tiny MLA (2 layers, latent 32 + 16)", shape_for(2, 1, (32 + 16) // 2, "bfloat16")),
        ("tiny GQA, hidden 64 (2 layers, 2 KV heads x 16)", shape_for(2, 2, 16, "bfloat16")),
    ]
    out = []
    for i in range(0, len(rows), 2):
        (mla_name, mla), (gqa_name, gqa) = rows[i], rows[i + 1]
        for name, shape in ((mla_name, mla), (gqa_name, gqa)):
            per_gib = GIB // shape.bytes_per_token
            out.append(f"{name:50s} {shape.bytes_per_token:>8,} B/token {per_gib:>12,} tokens/GiB")
        out.append(f"{'':50s} GQA / MLA bytes: {gqa.bytes_per_token / mla.bytes_per_token:.2f}x")
    return out


def decode_attention(
    heads: int, context: int, batch: int, steps: int, device: str
) -> tuple[float, float, float]:
    """Median seconds of one layer's decode attention, expanded and absorbed, and their largest relative
    output difference."""
    rank, rope, nope, v = 512, 64, 128, 128
    torch.manual_seed(0)
    attn = MLAAttention(heads, rank, nope, rope, v, (nope + rope) ** -0.5)
    pool = DeviceKVPool(batch * (context + 1), 1, 1, 1, (rank + rope) // 2, torch.float32, device)
    pool.k_buffer[0].normal_()
    pool.v_buffer[0].normal_()
    w = torch.randn(heads * (nope + v), rank, device=device) * rank**-0.5
    w_uk, w_uv = w.view(heads, nope + v, rank).split((nope, v), dim=1)
    absorbed = (w_uk.contiguous(), w_uv.contiguous())
    slots = [torch.arange(1, context + 2) + i * (context + 1) for i in range(batch)]
    fb = ForwardBatch.for_decode([1] * batch, slots, device=device)
    q = torch.randn(batch, heads, nope + rope, device=device)
    latent = torch.randn(batch, rank + rope, device=device)

    def run(ab):
        attn.init_forward_metadata(fb)
        return attn.forward(q, latent, 0, fb, pool, lambda x: F.linear(x, w), ab)

    def timed(ab) -> float:
        run(ab)
        times = []
        for _ in range(steps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(ab)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    with torch.inference_mode():
        expanded, absorbed_out = run(None), run(absorbed)
        diff = ((expanded - absorbed_out).abs().max() / expanded.abs().max()).item()
        return timed(None), timed(absorbed), diff


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.mla", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("\n".join(kv_table()))
    expanded, absorbed, diff = decode_attention(args.heads, args.context, args.batch, args.steps, args.device)
    print(
        f"decode attention, {args.batch} seqs x {args.context + 1} tokens, {args.heads} heads, latent "
        f"512 + 64, float32 on {args.device} ({torch.get_num_threads()} threads): expanded "
        f"{expanded * 1e3:.1f} ms, absorbed {absorbed * 1e3:.1f} ms, ratio {expanded / absorbed:.1f}x; "
        f"max relative difference {diff:.1e}"
    )
    return 0 if diff <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
