"""Tokens per byte of a quantized KV cache, and hit rate per eviction / admission policy, on Mooncake traces.

``python -m engine.bench.kv_capacity [--model-path smollm2] [--traces conversation synthetic] [--part all]``

``--part tiers``: tokens one GiB holds in each tier for every ``--kv-cache-dtype``, measured on real
objects: an L1 ``DeviceKVPool`` and an L2 ``HostKVPool`` (bytes of their buffers per token) and the ``file``
L3 backend (bytes of a written page file, header included, per token); ratios against the compute dtype
(float32 on the CPU, bfloat16 in the fast mode) in the same run.

``--part served``: the share of prompt tokens served from cache on each trace at fixed tier bytes
(``--l1-gib``/``--l2-gib``/``--l3-gib``) per KV dtype, through the what-if replay (the engine's own cache
policy), against the compute dtype at the same bytes.

``--part policies``: share served by each eviction policy and admission filter at the same capacity
(``--policy-l1-tokens`` etc.), against LRU without admission in the same run, beside the trace's ceiling
(an unbounded L1: the share of tokens that repeat at all), and Belady's MIN (``belady``: the offline optimum
at that capacity, evicting what the trace uses again farthest in the future).
"""

from __future__ import annotations

import argparse
import math
import platform
import tempfile
import time
from pathlib import Path

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.cache.host_pool import HostKVPool
from engine.cache.keys import page_hashes
from engine.cache.storage.base import HiCacheStorageConfig
from engine.cache.storage.registry import create_storage_backend
from engine.model.loader import load_config
from engine.whatif.replay import Capacities, replay_trace
from engine.whatif.trace import SHARED_TRACE_DIR, load_trace

GIB = 1 << 30
DTYPES = ("float32", "bfloat16", "fp8_e4m3", "int8")
POLICIES = (
    ("lru", "none", "none"),
    ("lfu", "none", "none"),
    ("fifo", "none", "none"),
    ("mru", "none", "none"),
    ("filo", "none", "none"),
    ("arc", "none", "none"),
    ("belady", "none", "none"),  # the offline optimum (engine/whatif/belady.py): what no policy exceeds
    ("lru", "tinylfu", "none"),
    ("lru", "tinylfu", "tinylfu"),
    ("lfu", "tinylfu", "tinylfu"),
)


def file_backend(l1: DeviceKVPool, host: HostKVPool, directory: str):
    """``(config, backend)``: a ``file`` L3 backend in ``directory`` for ``host``'s pages (its page size and
    layout) in ``l1``'s KV format, as one rank of tp 1."""
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        is_mla_model=False,
        model_name="bench",
        page_size=host.page_size,
        kv_dtype=str(l1.dtype),
        layout=host.layout,
        extra_config={"file_path": directory},
        kv_format=l1.kv_format.layout_name,
    )
    return config, create_storage_backend("file", config, host)


def tier_bytes_per_token(cfg, kv: str, page_size: int) -> dict[str, float]:
    """Bytes per token in L1, L2 (page_first) and L3 (file backend, one written page) for KV dtype ``kv``."""
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    compute = torch.bfloat16 if kv == "bfloat16" else torch.float32
    tokens = 4 * page_size
    flag = "auto" if kv == "float32" else kv  # float32 is the CPU's compute dtype, --kv-cache-dtype auto
    l1 = DeviceKVPool(tokens, page_size, *shape, dtype=compute, kv_cache_dtype=flag)
    l2 = HostKVPool(
        tokens, page_size, shape[0], shape[1], l1.row_dim, l1.dtype, "page_first", pin_memory=False
    )
    out = {
        "L1": l1.kv_buffer[:, :, page_size:].nbytes / tokens,
        "L2": l2.kv_buffer.nbytes / tokens,
    }
    with tempfile.TemporaryDirectory() as tmp:
        config, backend = file_backend(l1, l2, tmp)
        key = page_hashes(list(range(page_size)), page_size, None, config.namespace)[0]
        backend.set(key, l2.get_flat_data_page(0))
        out["L3"] = sum(p.stat().st_size for p in Path(tmp).glob("*.bin")) / page_size
        backend.close()
    return out


def part_tiers(cfg, page_size: int) -> None:
    print(f"\n== tokens per GiB by tier (page {page_size} tokens; L3: file backend, header included) ==")
    rows = {kv: tier_bytes_per_token(cfg, kv, page_size) for kv in DTYPES}
    print(
        f"{'kv dtype':<10}"
        + "".join(f"{t + ' tok/GiB':>14}" for t in ("L1", "L2", "L3"))
        + "  vs float32  vs bf16"
    )
    for kv, per in rows.items():
        cells = "".join(f"{GIB / per[t]:>14,.0f}" for t in ("L1", "L2", "L3"))
        vs32 = rows["float32"]["L2"] / per["L2"]
        vs16 = rows["bfloat16"]["L2"] / per["L2"]
        print(f"{kv:<10}{cells}{vs32:>11.2f}x{vs16:>8.2f}x")


def _share(c) -> float:
    return (c.served_l1 + c.served_l2 + c.served_l3) / max(c.input_tokens, 1)


def part_served(cfg, traces: dict, args) -> None:
    gib = (args.l1_gib, args.l2_gib, args.l3_gib)
    print(f"\n== served share at fixed bytes: L1 {gib[0]} GiB, L2 {gib[1]} GiB, L3 {gib[2]} GiB ==")
    per_token = {kv: tier_bytes_per_token(cfg, kv, args.page_size)["L2"] for kv in DTYPES}
    for name, reqs in traces.items():
        shares = {}
        for kv in DTYPES:
            caps = Capacities(*(g * GIB / per_token[kv] if g else 0 for g in gib))
            c = replay_trace(reqs, caps, block_tokens=args.block_tokens, page_size=args.page_size)
            shares[kv] = _share(c)
        base32, base16 = shares["float32"], shares["bfloat16"]
        for kv, share in shares.items():
            print(
                f"{name:<14}{kv:<10} served {share:7.2%}   vs float32 {share / base32:5.2f}x"
                f"   vs bfloat16 {share / base16:5.2f}x"
            )


def part_policies(traces: dict, args) -> None:
    caps = Capacities(args.policy_l1_tokens, args.policy_l2_tokens, args.policy_l3_tokens)
    print(
        f"\n== served share by policy at L1 {caps.l1:,.0f} / L2 {caps.l2:,.0f} / L3 {caps.l3:,.0f} tokens =="
    )
    for name, reqs in traces.items():
        if args.no_ceiling:
            print(f"{name}:")
        else:
            unbounded = Capacities(math.inf)
            ceiling = _share(
                replay_trace(reqs, unbounded, block_tokens=args.block_tokens, page_size=args.page_size)
            )
            print(f"{name}: ceiling (unbounded L1: tokens that repeat at all) {ceiling:.2%}")
        base = None
        for eviction, l2_adm, l3_adm in POLICIES:
            if args.no_admission and (l2_adm, l3_adm) != ("none", "none"):
                continue
            if args.evictions and eviction not in args.evictions:
                continue
            start = time.process_time()
            c = replay_trace(
                reqs,
                caps,
                block_tokens=args.block_tokens,
                page_size=args.page_size,
                eviction_policy=eviction,
                l2_admission=l2_adm,
                l3_admission=l3_adm,
            )
            share = _share(c)
            base = share if base is None else base
            label = f"{eviction}+l2:{l2_adm}+l3:{l3_adm}"
            print(
                f"  {label:<30} served {share:7.2%}  vs lru {share / base:5.3f}x  "
                f"L3 writes {c.written_l3_pages:>8,} pages  ({time.process_time() - start:.1f} s cpu)"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default="smollm2")
    ap.add_argument("--traces", nargs="+", default=["conversation", "synthetic"])
    ap.add_argument("--part", choices=("all", "tiers", "served", "policies"), default="all")
    ap.add_argument("--block-tokens", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--l1-gib", type=float, default=4)
    ap.add_argument("--l2-gib", type=float, default=16)
    ap.add_argument("--l3-gib", type=float, default=64)
    ap.add_argument("--policy-l1-tokens", type=float, default=500_000)
    ap.add_argument("--policy-l2-tokens", type=float, default=2_000_000)
    ap.add_argument("--policy-l3-tokens", type=float, default=8_000_000)
    ap.add_argument(
        "--no-admission", action="store_true", help="policies: eviction policies only (a single tier)"
    )
    ap.add_argument("--evictions", nargs="+", help="policies: only these eviction policies (lru first)")
    ap.add_argument("--no-ceiling", action="store_true", help="policies: skip the unbounded replay")
    ap.add_argument("--trace-dir", type=Path, default=SHARED_TRACE_DIR, help="where NAME_trace.jsonl are")
    args = ap.parse_args(argv)
    cfg = load_config(args.model_path)
    cpu = platform.processor() or platform.machine()
    print(
        f"model {args.model_path}: {cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads x "
        f"head_dim {cfg.head_dim}; {cpu}, torch {torch.__version__}"
    )
    if args.part in ("all", "tiers"):
        part_tiers(cfg, args.page_size)
    if args.part == "tiers":
        return 0
    traces = {
        name: load_trace(args.trace_dir / f"{name}_trace.jsonl", args.block_tokens) for name in args.traces
    }
    if args.part in ("all", "served"):
        part_served(cfg, traces, args)
    if args.part in ("all", "policies"):
        part_policies(traces, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
