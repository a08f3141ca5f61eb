"""``python -m engine.sizing``: KV bytes per token and per-tier token capacity for a worker's launch flags.

The model is ``--model-path`` (only its config is read) or ``--num-layers`` / ``--num-kv-heads`` /
``--head-dim``; the KV dtype is ``--kv-cache-dtype`` as the engine resolves it (``auto``: the compute
``--dtype``, itself ``auto``: on cpu bfloat16 for a Q4_1 GGUF and float32 otherwise, bfloat16 on cuda;
``engine/model/compute_mode.py``, which ``--torchao-config`` takes part in as on the worker).
L1 follows ``--max-total-tokens`` or ``--mem-fraction-static`` of ``--free-gpu-memory-gb`` (cuda),
L2 ``--hicache-ratio`` / ``--hicache-size`` with ``--enable-hierarchical-cache`` against
``--host-memory-gb`` (default: this host's MemAvailable), L3 ``--l3-gb``. ``--json`` prints one object.
Exit status 2 with a message naming the flag on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.cache.host_pool import available_memory
from engine.cache.kv_dtypes import resolve_kv_cache_dtype
from engine.model.compute_mode import compute_for_path
from engine.model.errors import ModelLoadError
from engine.sizing.kv import KVShape, model_kv_shape, shape_for
from engine.sizing.tiers import size_tiers

GB = 1e9


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.sizing", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model-path", default="smollm2")
    a("--num-layers", type=int, help="with --num-kv-heads and --head-dim instead of --model-path")
    a("--num-kv-heads", type=int)
    a("--head-dim", type=int)
    a("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"), help="compute dtype")
    a(
        "--torchao-config",
        default="",
        help="the worker's weight quantization (with --dtype auto it decides the dtype)",
    )
    a("--kv-cache-dtype", default="auto", help="KV dtype: auto (the compute dtype), bfloat16, fp8_e4m3, ...")
    a("--device", choices=("cpu", "cuda"), default="cpu")
    a("--tp-size", "--tp", type=int, default=1, dest="tp_size", help="ranks: L1/L2 are sized per rank")
    a("--page-size", type=int, default=1)
    a("--max-total-tokens", type=int, default=None)
    a("--mem-fraction-static", type=float, default=None)
    a("--free-gpu-memory-gb", type=float, default=None, help="free GPU memory after the weights (cuda)")
    a("--enable-hierarchical-cache", action="store_true")
    a("--hicache-ratio", type=float, default=2.0)
    a("--hicache-size", type=int, default=0, help="host pool GB; overrides --hicache-ratio when > 0")
    a("--host-memory-gb", type=float, default=None, help="available host RAM (default: this host's)")
    a("--l3-gb", type=float, default=0.0)
    a("--json", action="store_true")
    return p


def kv_shape(args: argparse.Namespace, parser: argparse.ArgumentParser) -> KVShape:
    given = [args.num_layers, args.num_kv_heads, args.head_dim]
    model = None if any(v is not None for v in given) else args.model_path
    try:  # as the engine resolves it (a Q4_1 GGUF: bfloat16 on a CPU)
        quant = args.torchao_config or None
        compute, _ = compute_for_path(args.dtype, quant, args.device, model) if model else (args.dtype, quant)
    except ModelLoadError as exc:
        parser.error(f"--model-path: {exc}")
    if compute == "auto":  # the shape is given, no model to read: the rule without a GGUF layout
        compute = "bfloat16" if args.device != "cpu" or (quant or "").startswith("int4wo") else "float32"
    try:
        dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, compute)
    except ValueError as exc:
        parser.error(f"--kv-cache-dtype: {exc}")
    try:
        shape_for(1, 1, 1, dtype)
    except ValueError as exc:
        parser.error(f"--dtype: {exc}")
    if model is None:
        if any(v is None or v < 1 for v in given):
            parser.error("--num-layers, --num-kv-heads and --head-dim go together, each >= 1")
        return shape_for(*given, dtype)
    try:
        return model_kv_shape(args.model_path, dtype)
    except ModelLoadError as exc:
        parser.error(f"--model-path: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and args.max_total_tokens is None and args.free_gpu_memory_gb is None:
        parser.error("--free-gpu-memory-gb: needed on cuda without --max-total-tokens")
    whole = kv_shape(args, parser)
    try:
        shape = whole.per_rank(args.tp_size)
    except ValueError as exc:
        parser.error(str(exc))
    host = available_memory() if args.host_memory_gb is None else int(args.host_memory_gb * GB)
    free_gpu = int(args.free_gpu_memory_gb * GB) if args.free_gpu_memory_gb is not None else None
    try:
        sizing = size_tiers(
            shape.bytes_per_token,
            args.page_size,
            max_total_tokens=args.max_total_tokens,
            mem_fraction_static=args.mem_fraction_static,
            free_gpu_bytes=free_gpu if args.device == "cuda" else None,
            enable_hierarchical_cache=args.enable_hierarchical_cache,
            hicache_ratio=args.hicache_ratio,
            hicache_size=args.hicache_size,
            host_available_bytes=host // args.tp_size,  # the ranks' host pools share this host's RAM
            l3_bytes=int(args.l3_gb * GB),
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps({**sizing.as_dict(), "tp_size": args.tp_size, "num_kv_heads": shape.num_kv_heads}))
        return 0
    s = sizing
    dims = f"2 x {shape.num_layers} layers x {shape.num_kv_heads} KV heads x head_dim {shape.head_dim}"
    dims += f" x {shape.dtype_bytes} B" + (f" + {shape.scale_bytes} B scale" if shape.scale_bytes else "")
    rank = f" per rank of {args.tp_size} ({whole.num_kv_heads} KV heads split)" if args.tp_size > 1 else ""
    if shape.latent_dim is not None:  # MLA: one latent per token and layer, the same on every rank
        scales = f" + 2 x {shape.scale_bytes} B scales" if shape.scale_bytes else ""
        dims = f"{shape.num_layers} layers x MLA latent {shape.latent_dim} x {shape.dtype_bytes} B{scales}"
        rank = f" per rank of {args.tp_size} (the latent replicated)" if args.tp_size > 1 else ""
    print(f"KV bytes per token{rank}: {s.bytes_per_token:,} ({dims}); page {s.page_size} tokens")
    print(f"L1 {s.l1_tokens:>14,} tokens  {s.l1_bytes / GB:10.2f} GB")
    print(f"L2 {s.l2_tokens:>14,} tokens  {s.l2_bytes / GB:10.2f} GB")
    if s.host_ram_left_bytes is not None:
        print(f"   host RAM left after L2: {s.host_ram_left_bytes / GB:.2f} GB")
    print(f"L3 {s.l3_tokens:>14,} tokens  {s.l3_bytes / GB:10.2f} GB")
    for warning in s.warnings:
        print(f"warning: {warning}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
