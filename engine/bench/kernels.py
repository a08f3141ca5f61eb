"""GPU benchmark of the kernels: correctness on the device first, then speed against same-run baselines.

``python -m engine.bench.kernels`` (needs CUDA; a few minutes on one H100/H200-class GPU). ``--tiny`` shrinks
every shape so the script's own logic can be checked on a CPU under ``TRITON_INTERPRET=1``; its timings are
then meaningless and it says so.

1. Checks: the page-transfer kernel against torch indexing (every host layout, both directions, page sizes
   1/16/64, fp16/bf16/fp32, destinations pre-filled with NaN), decode and extend attention against dense
   masked SDPA (fp32 within 1e-5, bf16/fp16 within 2e-2, GQA 1/4, decode split over the keys); an MLA
   pool's row (one KV head, half the latent per K / V row) moves like any other. Then the MLA and DP-attention
   cases (``engine/bench/mla_dp_check.py``): absorbed vs expanded MLA decode on the device, and a tiny
   DeepSeek-V3 (MLA + MoE) worker at ``--dp-size 2 --enable-dp-attention`` equal to dp 1, a conversation's
   next turn served by its DP rank's L1. Any failure exits 1 before timing.
2. Transfer table, a Llama-3-8B-like KV (32 layers, 8 KV heads, head_dim 128, bf16) moving ``--tokens``
   tokens between scattered pages of a device pool and a pinned host pool: GB/s of the ``kernel`` io backend
   (one launch per layer for H2D as the load-back issues it, one launch for all layers for D2H), of the
   ``direct`` backend on the same pages, and of one contiguous pinned copy of the same bytes (the ceiling).
3. Attention table: Triton decode (batch 64, and batch 1 with split-KV) and extend over the page table vs
   torch SDPA on the same K/V already gathered into dense tensors (the baseline) and vs the engine's torch
   backend (gather + SDPA).
4. Load-back overlap: per-layer compute (a bf16 matmul per layer) alone, the kernel load-back alone, one after
   the other, and overlapped the way the engine runs them (loads on the load stream, layer i's compute waiting
   on layer i's event).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.bench import mla_dp_check
from engine.cache.device_pool import DeviceKVPool
from engine.cache.host_pool import HostKVPool
from engine.cache.io_backends import DirectIO, KernelIO
from engine.model.attention.torch_backend import TorchAttentionBackend
from engine.model.forward_batch import ForwardBatch
from kernels import interpreting, unavailable_reason
from kernels.attention import decode_attention, extend_attention, num_decode_splits
from kernels.transfer import PagedKV, copy_pages, layout_strides

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device, iters: int) -> float:
    """Seconds per call of ``fn`` (after one warm-up call): CUDA events around ``iters`` calls on the
    current stream, or wall time on the CPU."""
    fn()
    _sync(device)
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


# -- 1. correctness -----------------------------------------------------------------------------------------
def _page_view(buf: torch.Tensor, layout: str, page: int, P: int) -> torch.Tensor:
    if layout == "layer_first":
        return buf[:, :, page * P : (page + 1) * P]
    if layout == "page_first":
        return buf[:, page * P : (page + 1) * P].transpose(1, 2)
    return buf[:, page]


def _host_shape(layout: str, L: int, N: int, P: int, H: int, D: int) -> tuple[int, ...]:
    return {
        "layer_first": (2, L, N, H, D),
        "page_first": (2, N, L, H, D),
        "page_first_direct": (2, N // P, L, P, H, D),
    }[layout]


def check_transfer(device: torch.device) -> list[str]:
    """Failures of the transfer kernel against torch indexing (empty when all pass)."""
    failures, L = [], 2
    pin = device.type == "cuda"
    # (H, D) = (1, 36): an MLA pool's rows (one KV head; a 72-value latent, half in each of K and V)
    for (H, D), layout, P, dtype in itertools.product(((2, 8), (1, 36)), LAYOUTS, (1, 16, 64), DTYPES):
        dev = torch.randn(2, L, 8 * P, H, D, device=device).to(dtype)
        host = torch.full(_host_shape(layout, L, 10 * P, P, H, D), float("nan"), dtype=dtype)
        host = host.pin_memory() if pin else host
        dk = PagedKV.from_strides(dev, **layout_strides("layer_first", L, 8 * P, P, H * D), row=H * D)
        hk = PagedKV.from_strides(host, **layout_strides(layout, L, 10 * P, P, H * D), row=H * D)
        src = torch.tensor([3, 1, 1, 7, 5], device=device)  # a repeated source page
        dst = torch.tensor([9, 0, 4, 2, 6], device=device)  # scattered destinations
        copy_pages(dk, hk, src, dst, P, 0, L)
        _sync(device)
        ok = all(
            torch.equal(_page_view(host, layout, d, P), _page_view(dev, "layer_first", s, P).cpu())
            for s, d in zip(src.tolist(), dst.tolist(), strict=True)
        )
        dev.fill_(float("nan"))
        back = torch.tensor([6, 4, 0], device=device)
        into = torch.tensor([2, 7, 5], device=device)
        for layer in range(L):
            copy_pages(hk, dk, back, into, P, layer)
        _sync(device)
        ok = ok and all(
            torch.equal(_page_view(dev, "layer_first", d, P).cpu(), _page_view(host, layout, s, P))
            for s, d in zip(back.tolist(), into.tolist(), strict=True)
        )
        if not ok:
            failures.append(f"transfer {layout} page {P} {dtype} {H} heads x {D}")
    return failures


def _dense_reference(q, k_buf, v_buf, table, seq_lens, extend_lens, scale):
    group = q.shape[1] // k_buf.shape[1]
    outs, start = [], 0
    for b, (n, e) in enumerate(zip(seq_lens, extend_lens, strict=True)):
        keys = k_buf[table[b, :n]].float().repeat_interleave(group, 1).transpose(0, 1)
        values = v_buf[table[b, :n]].float().repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - e, n, device=q.device)[:, None]
        out = F.scaled_dot_product_attention(
            q[start : start + e].float().transpose(0, 1), keys, values, attn_mask=mask, scale=scale
        )
        outs.append(out.transpose(0, 1))
        start += e
    return torch.cat(outs)


def check_attention(device: torch.device) -> list[str]:
    """Failures of decode / extend attention against dense masked SDPA (empty when all pass)."""
    failures, kv_heads, dim = [], 2, 64
    prefixes, extends = [0, 1, 15, 16, 53], [5, 1, 17, 3, 20]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-2)):
        for group in (1, 4):
            for decode in (False, True):
                ext = [1] * len(prefixes) if decode else extends
                seq_lens = [p + e for p, e in zip(prefixes, ext, strict=True)]
                total = sum(seq_lens)
                k_buf = torch.full((total + 64, kv_heads, dim), float("nan"), device=device, dtype=dtype)
                v_buf = k_buf.clone()
                slots = torch.randperm(total + 64, device=device)[:total]
                k_buf[slots] = torch.randn(total, kv_heads, dim, device=device).to(dtype)
                v_buf[slots] = torch.randn(total, kv_heads, dim, device=device).to(dtype)
                table = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.long, device=device)
                offsets = [0, *torch.tensor(seq_lens).cumsum(0).tolist()]
                for b, n in enumerate(seq_lens):
                    table[b, :n] = slots[offsets[b] : offsets[b] + n]
                q = torch.randn(sum(ext), kv_heads * group, dim, device=device).to(dtype)
                out = torch.full_like(q, float("nan"))
                lens = torch.tensor(seq_lens, device=device)
                scale = dim**-0.5
                if decode:  # split-KV when the longest sequence allows it
                    decode_attention(q, k_buf, v_buf, out, table, lens, scale, num_splits=1 + group)
                else:
                    cu = torch.tensor([0, *ext], device=device).cumsum(0)
                    extend_attention(q, k_buf, v_buf, out, table, lens, cu, max(ext), scale)
                ref = _dense_reference(q, k_buf, v_buf, table, seq_lens, ext, scale)
                err = (out.float() - ref).abs().max().item()
                if not err <= tol:
                    name = "decode" if decode else "extend"
                    failures.append(f"{name} {dtype} group {group}: max error {err:.2e} > {tol}")
    return failures


# -- 2. transfer bandwidth ----------------------------------------------------------------------------------
def bench_transfer(
    device: torch.device, tokens: int, layers: int, heads: int, dim: int, iters: int
) -> list[dict]:
    """Rows ``{direction, page, layout, backend: GB/s...}`` for the kernel, direct and contiguous copies."""
    rows, dtype = [], torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    for P in (1, 16, 64):
        pages = tokens // P
        dev_pool = DeviceKVPool(4 * pages * P, P, layers, heads, dim, dtype, device)
        dev_pages = torch.randperm(4 * pages, generator=gen)[:pages] + 1  # scattered, never the padding page
        host_pages = torch.randperm(2 * pages, generator=gen)[:pages]
        dev_slots = (dev_pages[:, None] * P + torch.arange(P)).flatten()
        host_slots = (host_pages[:, None] * P + torch.arange(P)).flatten()
        nbytes = 2 * layers * pages * P * heads * dim * dtype.itemsize
        ceiling = _contiguous_gbps(device, nbytes, iters)
        for layout in LAYOUTS:
            host_pool = HostKVPool(2 * pages * P, P, layers, heads, dim, dtype, layout)
            row = {"page": P, "layout": layout, "MiB": nbytes / 2**20}
            for name, cls in (("kernel", KernelIO), ("direct", DirectIO)):
                if layout not in cls.layouts:
                    continue
                io = cls(dev_pool, host_pool)
                plan = io.plan(dev_slots, host_slots)
                row[f"{name} H2D"] = (
                    nbytes / timed(lambda io=io, plan=plan: io.issue_load(plan), device, iters) / 1e9
                )
                row[f"{name} D2H"] = (
                    nbytes / timed(lambda io=io, plan=plan: io.issue_backup(plan), device, iters) / 1e9
                )
            for d in ("H2D", "D2H"):
                row[f"ceiling {d}"] = ceiling[d]
                row[f"kernel/ceiling {d}"] = row[f"kernel {d}"] / ceiling[d]
                if f"direct {d}" in row:
                    row[f"kernel/direct {d}"] = row[f"kernel {d}"] / row[f"direct {d}"]
            rows.append(row)
    return rows


def _contiguous_gbps(device: torch.device, nbytes: int, iters: int) -> dict[str, float]:
    """GB/s of one copy of ``nbytes`` between a contiguous device tensor and a pinned host tensor."""
    flat_dev = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    flat_host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    return {
        "H2D": nbytes / timed(lambda: flat_dev.copy_(flat_host, non_blocking=True), device, iters) / 1e9,
        "D2H": nbytes / timed(lambda: flat_host.copy_(flat_dev, non_blocking=True), device, iters) / 1e9,
    }


# -- 3. attention -------------------------------------------------------------------------------------------
def bench_attention(
    device: torch.device,
    batch: int,
    prefix: int,
    extend: int,
    heads: int,
    kv_heads: int,
    dim: int,
    iters: int,
) -> list[dict]:
    """Milliseconds per call of Triton decode / extend vs dense SDPA and the engine's torch backend (bf16)."""
    shape = {"prefix": prefix, "heads": heads, "kv_heads": kv_heads, "dim": dim, "iters": iters}
    cases = (("decode", 1, batch), ("decode", 1, 1), ("extend", extend, batch))  # batch 1: split-KV decode
    return [_attention_row(device, mode, new, batch=b, **shape) for mode, new, b in cases]


def _attention_row(
    device: torch.device,
    mode: str,
    new: int,
    batch: int,
    prefix: int,
    heads: int,
    kv_heads: int,
    dim: int,
    iters: int,
) -> dict:
    dtype, seq, scale = torch.bfloat16, prefix + new, dim**-0.5
    pool = DeviceKVPool(batch * seq + 64, 1, 1, kv_heads, dim, dtype, device)
    pool.kv_buffer.normal_()
    slots = torch.randperm(batch * seq, device=device).view(batch, seq) + 1
    fb = ForwardBatch.from_sequences([[1] * new] * batch, list(slots.cpu()), device=device)
    q = torch.randn(batch * new, heads, dim, device=device, dtype=dtype)
    k_buf, v_buf = pool.get_kv(0)
    out = torch.empty_like(q)

    splits = num_decode_splits(batch, kv_heads, seq) if mode == "decode" else 1

    def triton_call():
        if mode == "decode":
            decode_attention(q, k_buf, v_buf, out, fb.req_to_token, fb.seq_lens, scale, splits)
        else:
            extend_attention(q, k_buf, v_buf, out, fb.req_to_token, fb.seq_lens, fb.cu_seqlens, new, scale)

    keys = k_buf[slots].transpose(1, 2)  # (B, Hkv, S, D), gathered once: the dense baseline
    values = v_buf[slots].transpose(1, 2)
    queries = q.view(batch, new, heads, dim).transpose(1, 2)
    mask = None
    if mode == "extend":
        mask = torch.arange(seq, device=device)[None, :] <= torch.arange(prefix, seq, device=device)[:, None]

    def sdpa_call():
        F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)

    torch_backend = TorchAttentionBackend(heads, kv_heads, dim, scale)
    k_new = k_buf[fb.out_cache_loc].clone()
    v_new = v_buf[fb.out_cache_loc].clone()

    def engine_torch_call():
        torch_backend.init_forward_metadata(fb)
        torch_backend.forward(q, k_new, v_new, 0, fb, pool)

    row = {"mode": mode, "batch": batch, "prefix": prefix, "new": new, "splits": splits}
    row["triton ms"] = timed(triton_call, device, iters) * 1e3
    row["sdpa ms"] = timed(sdpa_call, device, iters) * 1e3
    row["engine torch ms"] = timed(engine_torch_call, device, iters) * 1e3
    row["sdpa/triton"] = row["sdpa ms"] / row["triton ms"]
    return row


# -- 4. load-back overlap -----------------------------------------------------------------------------------
def bench_overlap(
    device: torch.device, tokens: int, layers: int, heads: int, dim: int, width: int, iters: int
) -> dict:
    """Milliseconds of per-layer compute alone, kernel load-back alone, serial, and overlapped."""
    dtype, P = torch.bfloat16, 16
    pages = tokens // P
    dev_pool = DeviceKVPool(2 * tokens, P, layers, heads, dim, dtype, device)
    host_pool = HostKVPool(2 * tokens, P, layers, heads, dim, dtype, "page_first")
    io = KernelIO(dev_pool, host_pool)
    slots = (torch.randperm(pages)[:, None] * P + P + torch.arange(P)).flatten()
    host_slots = (torch.randperm(2 * pages)[:pages, None] * P + torch.arange(P)).flatten()
    x = torch.randn(width, width, device=device, dtype=dtype)
    w = torch.randn(width, width, device=device, dtype=dtype) / width**0.5

    def compute(ready=None):
        y = x
        for layer in range(layers):
            if ready is not None:
                io.wait_loaded(ready[layer])
            y = y @ w
        return y

    def load():
        plan = io.prepare_load(slots, host_slots, io.compute_mark())
        return [io.load_layer(layer, plan) for layer in range(layers)]

    def serial():
        for ready in load():
            io.wait_loaded(ready)
        compute()

    def overlapped():
        compute(load())

    def load_only():
        for ready in load():
            io.wait_loaded(ready)

    row = {"MiB": 2 * layers * tokens * heads * dim * dtype.itemsize / 2**20}
    for name, fn in (
        ("compute", compute),
        ("load-back", load_only),
        ("serial", serial),
        ("overlapped", overlapped),
    ):
        row[f"{name} ms"] = timed(fn, device, iters) * 1e3
    # 1.0: the load-back hides entirely behind compute (or vice versa); 0.0: no overlap at all
    hidden = row["serial ms"] - row["overlapped ms"]
    row["overlap"] = hidden / min(row["compute ms"], row["load-back ms"])
    return row


def _table(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" for _ in cols) + "|"]
    for r in rows:
        cells = [f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.bench.kernels", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: checks the script on a CPU")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per transfer (default 8192)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reason = unavailable_reason(device)
    if reason:
        print(f"engine.bench.kernels: {reason}", file=sys.stderr)
        return 2
    if args.tiny:
        tokens, layers, heads, dim, iters, width = 128, 2, 2, 16, 1, 64
        attention = {"batch": 2, "prefix": 40, "extend": 16, "heads": 4, "kv_heads": 2, "dim": 16}
    else:
        tokens, layers, heads, dim, iters, width = args.tokens, 32, 8, 128, 5, 4096
        attention = {"batch": 64, "prefix": 2048, "extend": 512, "heads": 32, "kv_heads": 8, "dim": 128}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"# engine.bench.kernels on {name}, torch {torch.__version__}")
    if interpreting():
        print("TRITON_INTERPRET=1: timings below measure the interpreter, not a GPU; do not report them.")
    failures = check_transfer(device) + check_attention(device)
    failures += mla_dp_check.check_mla_decode(device, args.tiny) + mla_dp_check.check_dp_attention(device)
    if failures:
        print("FAILED checks:\n  " + "\n  ".join(failures))
        return 1
    print(
        "checks: transfer (GQA and MLA rows x 3 layouts x pages 1/16/64 x 3 dtypes, both directions), "
        "attention, MLA decode, DP attention on MLA + MoE OK\n"
    )
    print(f"## KV transfer, {layers} layers x {heads} KV heads x {dim}, bf16, {tokens} tokens (GB/s)\n")
    print(_table(bench_transfer(device, tokens, layers, heads, dim, iters)) + "\n")
    a = attention
    print(f"## Attention, {a['heads']} query / {a['kv_heads']} KV heads x {a['dim']}, bf16 (ms per call)\n")
    print(_table(bench_attention(device, iters=iters, **attention)) + "\n")
    print(f"## Load-back overlap ({layers} layers, {width}x{width} bf16 matmul per layer)\n")
    print(_table([bench_overlap(device, tokens, layers, heads, dim, width, iters)]))
    print("\n## Tensor parallelism (NCCL all-reduce per layer, decode step tp 2 vs tp 1)\n")
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        print("not measured: needs 2 CUDA devices")
        return 0
    from engine.bench import tp

    return tp.main(["--device", "cuda", "--tp", "2"])


if __name__ == "__main__":
    sys.exit(main())
