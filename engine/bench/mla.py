"""MLA (DeepSeek) KV bytes against GQA, and decode attention: absorbed latent vs expanded keys and values.

``python -m engine.bench.mla [--part compute|l3] [--heads 16] [--context 1024] [--batch 2] [--steps 10]
[--device cpu|cuda] [--threads N] [--prompts 8] [--prompt-tokens 48]``

``--part compute`` (the default) runs 1 and 2, ``--part l3`` runs 3:

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
3. The L3 write volume of an MLA model at tp 2: a tiny random DeepSeek-V3
   (``mla_dp_check.write_tiny_deepseek``) served with ``--tp-size 2`` and a write-through file L3 that logs
   each process's writes (``engine.bench.counting_storage``) gets ``--prompts`` distinct prompts; the bytes
   handed to the store (pages logged as written x their page file's size, per process) and the bytes on
   disk are counted once every backup is done. Baseline: every rank writing its full replica, i.e. tp x the
   bytes a tp-1 worker writes for the same prompts, measured by a tp-1 worker in the same run (the engine
   has no switch that makes every MLA rank write; its keys name no rank, so such writes would land on the
   same files). Prints bytes, pages, writer processes, the time from the first prompt sent to every backup
   done, and the ratio one-writer / baseline (target 1/tp); exit 1 when a rank other than rank 0 wrote or
   the ratio is not 1/tp.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.cache.device_pool import DeviceKVPool
from engine.cache.storage.page_file import HEADER_SIZE
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


def _written(log: Path, store: Path) -> tuple[Counter, Counter]:
    """``(pages, bytes)`` per writing process id from a counting store's log; a page's bytes are its file's
    size in ``store`` (the ``HEADER_SIZE`` header included)."""
    pages: Counter = Counter()
    nbytes: Counter = Counter()
    for line in log.read_text().splitlines() if log.exists() else []:
        op, pid, key = line.split(" ", 2)
        if op == "set":
            pages[int(pid)] += 1
            nbytes[int(pid)] += (store / f"{key}.bin").stat().st_size
    return pages, nbytes


def l3_write_volume(tp: int, prompts: int, prompt_tokens: int, folder: Path, work: Path) -> dict:
    """Serve ``prompts`` distinct prompts of ``prompt_tokens`` tokens on the model in ``folder`` at ``tp``
    with a fresh write-through counting file L3 under ``work``; once every backup is done (``/flush_cache``
    answers 200), count what reached the store. Returns ``pages``/``bytes`` handed to the store per process
    id, ``disk_pages``/``disk_bytes`` on disk, ``seconds`` from the first prompt sent to every backup done,
    and the worker's rank-0 ``pid``. Raises ``RuntimeError`` when the worker does not start, and
    ``TimeoutError`` when the backups are not done within 300 s."""
    import httpx

    from engine.bench.launcher import ServerProcess
    from engine.bench.mla_dp_check import VOCAB

    store, log = work / f"l3-tp{tp}", work / f"l3-tp{tp}.log"
    store.mkdir()
    extra = {"backend_name": "counting-file", "module_path": "engine.bench.counting_storage",
             "class_name": "CountingFileStorage", "file_path": str(store),
             "count_path": str(log)}  # fmt: skip
    flags = ["--model-path", str(folder), "--tp-size", str(tp), "--page-size", "4",
             "--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
             "--hicache-storage-backend", "dynamic",
             "--hicache-storage-backend-extra-config", json.dumps(extra)]  # fmt: skip
    ids = [
        [(7 * i + 3 * j + i * j) % (VOCAB - 20) + 10 for j in range(prompt_tokens)] for i in range(prompts)
    ]
    params = {"max_new_tokens": 1, "temperature": 0}
    with ServerProcess(flags, 600) as server, httpx.Client(base_url=server.url, timeout=300) as client:
        t0 = time.perf_counter()
        for p in ids:
            client.post("/generate", json={"input_ids": p, "sampling_params": params}).raise_for_status()
        deadline = time.monotonic() + 300
        while (resp := client.post("/flush_cache")).status_code != 200:  # 400 while backups still run
            if time.monotonic() > deadline:
                raise TimeoutError(f"tp {tp}: L3 backups not done after 300 s: {resp.text}")
            time.sleep(0.02)
        seconds = time.perf_counter() - t0
        assert server.proc is not None
        pid = server.proc.pid
    pages, nbytes = _written(log, store)
    on_disk = list(store.glob("*.bin"))
    return {"pages": pages, "bytes": nbytes, "disk_pages": len(on_disk),
            "disk_bytes": sum(f.stat().st_size for f in on_disk), "seconds": seconds, "pid": pid}  # fmt: skip


def l3_table(prompts: int, prompt_tokens: int, tp: int = 2) -> tuple[list[str], list[str]]:
    """Part 3: the table's lines and the failures (empty: one writer and a ratio of 1/tp)."""
    from engine.bench.mla_dp_check import write_tiny_deepseek

    with tempfile.TemporaryDirectory(prefix="kvfleet-mla-l3-") as tmp:
        folder, work = Path(tmp) / "model", Path(tmp)
        write_tiny_deepseek(folder)
        one = l3_write_volume(tp, prompts, prompt_tokens, folder, work)
        single = l3_write_volume(1, prompts, prompt_tokens, folder, work)
    one_bytes, replica = sum(one["bytes"].values()), sum(single["bytes"].values())
    one_pages, replica_pages = sum(one["pages"].values()), sum(single["pages"].values())
    baseline = tp * replica
    ratio = one_bytes / baseline if baseline else float("nan")

    def row(name: str, nbytes: int, pages: int, writers: int, run: dict | None) -> str:
        measured = f" {run['disk_bytes']:>10,} {run['seconds']:>10.2f}" if run else ""
        payload = nbytes - pages * HEADER_SIZE
        return f"{name:44s} {nbytes:>10,} {payload:>10,} {pages:>6} {writers:>7}{measured}"

    lines = [
        f"L3 write volume, tiny DeepSeek-V3 (MLA latent 32 + 16, 2 layers, page 4), {prompts} distinct "
        f"prompts x {prompt_tokens} tokens, file L3 write-through:",
        f"{'':44s} {'bytes':>10s} {'KV payload':>10s} {'pages':>6s} {'writers':>7s} {'on disk':>10s} "
        f"{'send->L3 s':>10s}",
        row(f"tp {tp}, one writer (measured)", one_bytes, one_pages, len(one["pages"]), one),
        row("tp 1, one replica (measured)", replica, replica_pages, len(single["pages"]), single),
        row(f"baseline: every rank writes (tp {tp} x tp 1)", baseline, tp * replica_pages, tp, None),
        f"one writer / baseline: {ratio:.3f} (target 1/tp = {1 / tp:.3f}); bytes are page files, each a "
        f"{HEADER_SIZE:,} B header + the page's KV",
    ]
    failures = []
    if list(one["pages"]) != [one["pid"]]:
        failures.append(f"tp {tp}: writers other than rank 0 (pid {one['pid']}): {dict(one['pages'])}")
    if not replica or abs(ratio - 1 / tp) > 1e-9:
        failures.append(f"one writer / baseline {ratio:.3f}, not 1/tp = {1 / tp:.3f}")
    return lines, failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.mla", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("compute", "l3"), default="compute",
                   help="compute: KV table and decode attention; l3: the tp-2 L3 write volume")  # fmt: skip
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--prompts", type=int, default=8, help="--part l3: distinct prompts")
    p.add_argument("--prompt-tokens", type=int, default=48, help="--part l3: tokens per prompt")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part == "l3":
        if args.prompts < 1 or args.prompt_tokens < 4:
            p.error("--prompts must be >= 1 and --prompt-tokens >= 4 (one page)")
        lines, failures = l3_table(args.prompts, args.prompt_tokens)
        print("\n".join(lines + failures))
        return 1 if failures else 0
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
