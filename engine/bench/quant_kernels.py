"""The quantized layers' kernels against torch's, by rows, in the same run.

``python -m engine.bench.quant_kernels [--rows 1 2 3 4 8 12 16 32 64] [--reps 5] [--threads 1]``

SmolLM2-135M's 120 projection shapes (30 x qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) with
random weights as int4wo-32 layers, and its LM head shape (49,152 x 576) as an int8wo layer, called back to
back so the weights stream from memory as in a decode step (not from cache). For each row count: torch's
weight-only kernel (``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``, bfloat16 activations),
KVFleet's VNNI kernel where it takes that many rows (``engine/model/fused/quant_gemv.cpp``) and the dense
bfloat16 matmul over the dequantized weight (``F.linear``, oneDNN); ms for all 120 projections (or the head),
the median of ``--reps`` calls, and each kernel's ratio to torch's in the same run. Where the CPU lacks
AVX512-VNNI / AVX512-BF16 those columns say so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from engine.model.extension import load_extension
from engine.model.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
HEAD = (49152, 576)


def _ms(call, reps: int) -> float:
    call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _row(name: str, rows: int, layers: list, reps: int) -> None:
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {x.in_features for x in layers}}
    torch_ms = _ms(lambda: [x.torch_mm(inputs[x.in_features]) for x in layers], reps)
    line = f"{name:<16}{rows:>5}{torch_ms:>11.2f}"
    if layers[0].vnni_blocks is None:
        line += f"{'no VNNI':>18}"
    elif rows <= layers[0].vnni_max_rows:
        vnni_ms = _ms(lambda: [x.vnni_mm(inputs[x.in_features]) for x in layers], reps)
        line += f"{vnni_ms:>11.2f}{vnni_ms / torch_ms:>7.2f}"
    else:
        line += f"{'-':>11}{'':>7}"
    if layers[0].dense_weight is None:
        line += f"{'no AVX512-BF16':>18}"
    else:
        dense_ms = _ms(lambda: [F.linear(inputs[x.in_features], x.dense_weight) for x in layers], reps)
        line += f"{dense_ms:>11.2f}{dense_ms / torch_ms:>7.2f}"
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 12, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = load_extension()
    torch.manual_seed(0)
    projections = [Int4WeightOnlyLinear(torch.randn(n, k), None, 32) for n, k in SHAPES]
    head = [Int8WeightOnlyLinear(torch.randn(*HEAD) * 0.05, None)]
    for layer in (*projections, *head):
        layer.use_cpu_kernels(ext)
    print(f"{args.threads} torch thread(s), load {os.getloadavg()[0]:.1f}; ms per call of every layer")
    print(f"{'layers':<16}{'rows':>5}{'torch ms':>11}{'VNNI ms':>11}{'ratio':>7}{'dense ms':>11}{'ratio':>7}")
    for rows in args.rows:
        _row("120 int4 proj.", rows, projections, args.reps)
        _row("int8 LM head", rows, head, args.reps)
    print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
