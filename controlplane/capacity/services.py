"""KV sizing arithmetic (the control plane's copy of ``engine/sizing/tiers.py``; the control plane never
imports the engine, and ``tests/controlplane/capacity/test_api.py`` checks both give the same answer).

Bytes per token = 2 x layers x KV heads x (head_dim x dtype bytes + scale bytes: int8 keeps one bfloat16
scale per token and KV head). A worker of ``--tp-size`` N has pools per rank, each for its share of the KV
heads (KV / N, or one replicated head when N exceeds them): its L1 and L2 are sized per rank, the tokens
the same on every rank, the bytes per token divided. L1 = ``max_total_tokens``, else
``mem_fraction_static`` (default 0.88) x free GPU memory / bytes per token, else (a cpu worker) 16,384;
whole pages, at least one. L2 (hierarchical only) = ``hicache_size`` GB / bytes per token when > 0, else
``hicache_ratio`` x L1, rounded up past whole pages (newer upstream). L3 = its bytes in whole pages.
"""

from __future__ import annotations

from controlplane.core.exceptions import ApplicationError

GIB = 1 << 30
CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384
DEFAULT_MEM_FRACTION_STATIC = 0.88
HIGH_MEM_FRACTION = 0.92
HOST_MEMORY_RESERVE = 10 * GIB
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
SCALE_BYTES = {"int8": 2}


def attention_tp_size(*, tp_size: int, dp_size: int) -> int:
    """The tp size of one DP rank's attention (the engine's DP-attention rule): ``tp_size / dp_size``, which
    must be 1 for ``dp_size`` > 1 (``dp_size`` == ``tp_size``); else ApplicationError 400 naming
    ``dp_size``."""
    if dp_size == 1:
        return tp_size
    if tp_size % dp_size or tp_size != dp_size:
        problem = (
            f"must divide tp_size {tp_size}" if tp_size % dp_size else f"must equal tp_size {tp_size}"
        ) + " (the engine refuses other --dp-size values with --enable-dp-attention)"
        raise ApplicationError(f"dp_size: {problem}", code="validation_error", detail={"dp_size": [problem]})
    return 1


def dp_l1_share(
    *,
    dp_size: int,
    page_size: int,
    bytes_per_token: int,
    max_total_tokens: int | None = None,
    mem_fraction_static: float | None = None,
    free_gpu_memory_bytes: int | None = None,
    **_,
) -> dict:
    """``{"max_total_tokens": one DP rank's L1}``: the engine sizes the worker's L1 as without DP (whole
    pages), then gives each of the ``dp_size`` ranks ``L1 // dp_size`` in whole pages (at least one)."""
    if max_total_tokens is not None:
        tokens = max_total_tokens
    elif free_gpu_memory_bytes is not None:
        fraction = mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
        tokens = int(free_gpu_memory_bytes * fraction) // bytes_per_token
    else:
        tokens = CPU_DEFAULT_MAX_TOTAL_TOKENS
    whole = max(page_size, tokens // page_size * page_size)
    return {"max_total_tokens": max(page_size, whole // dp_size // page_size * page_size)}


def kv_heads_per_rank(*, num_kv_heads: int, tp_size: int) -> int:
    """KV heads each of ``tp_size`` ranks holds (the engine's rule): KV / tp when tp divides them, one
    replicated head when tp is a multiple of them; else ApplicationError 400 naming ``tp_size``."""
    if (tp_size <= num_kv_heads and num_kv_heads % tp_size) or (
        tp_size > num_kv_heads and tp_size % num_kv_heads
    ):
        problem = (
            f"the model's {num_kv_heads} KV heads are not divisible by {tp_size}"
            if tp_size <= num_kv_heads
            else f"more ranks than the model's {num_kv_heads} KV heads needs a multiple of them"
        )
        raise ApplicationError(
            f"tp_size: {problem} (the engine refuses --tp-size {tp_size})",
            code="validation_error",
            detail={"tp_size": [problem]},
        )
    return max(1, num_kv_heads // tp_size)


def kv_bytes_per_token(
    *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, tp_size: int = 1
) -> int:
    """One rank's KV bytes per token (``tp_size`` 1: the whole worker's)."""
    heads = kv_heads_per_rank(num_kv_heads=num_kv_heads, tp_size=tp_size)
    return 2 * num_layers * heads * (head_dim * DTYPE_BYTES[dtype] + SCALE_BYTES.get(dtype, 0))


def kv_sizing(
    *,
    bytes_per_token: int,
    page_size: int,
    max_total_tokens: int | None = None,
    mem_fraction_static: float | None = None,
    free_gpu_memory_bytes: int | None = None,
    enable_hierarchical_cache: bool = False,
    hicache_ratio: float = 2.0,
    hicache_size: float = 0,
    host_memory_bytes: int | None = None,
    l3_bytes: int = 0,
) -> dict:
    """Per-tier tokens and bytes, host RAM left after L2, and warnings (same rules as the engine's)."""
    warnings = []
    fraction = mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
    if max_total_tokens is not None:
        l1 = max_total_tokens
        if max_total_tokens % page_size:
            warnings.append(
                f"--max-total-tokens {max_total_tokens} is not a multiple of --page-size {page_size}"
            )
    elif free_gpu_memory_bytes is not None:
        l1 = int(free_gpu_memory_bytes * fraction) // bytes_per_token
        if fraction > HIGH_MEM_FRACTION:
            warnings.append(
                f"--mem-fraction-static {fraction} leaves {(1 - fraction):.0%} of free GPU memory for "
                "activations and CUDA graphs: expect out-of-memory under load (0.85-0.9 is usual)"
            )
    else:
        l1 = CPU_DEFAULT_MAX_TOTAL_TOKENS
    l1 = max(page_size, l1 // page_size * page_size)
    l2, ram_left = 0, None
    if enable_hierarchical_cache:
        l2 = int(hicache_size * 1e9 / bytes_per_token) if hicache_size > 0 else int(l1 * hicache_ratio)
        l2 = (l2 // page_size + 1) * page_size
        if l2 <= l1:
            warnings.append(
                f"host pool ({l2} tokens) is not larger than L1 ({l1} tokens): the engine refuses to start; "
                "raise --hicache-ratio above 1 or --hicache-size"
            )
        if host_memory_bytes is not None:
            ram_left = host_memory_bytes - l2 * bytes_per_token
            reserve = min(HOST_MEMORY_RESERVE, host_memory_bytes // 4)
            if ram_left < reserve:
                warnings.append(
                    f"host pool needs {l2 * bytes_per_token / GIB:.2f} GiB of {host_memory_bytes / GIB:.2f} "
                    f"GiB available, leaving less than the {reserve / GIB:.2f} GiB reserve: it would swap "
                    "(the engine refuses to start); lower --hicache-ratio or --hicache-size"
                )
    l3 = l3_bytes // (page_size * bytes_per_token) * page_size
    if l3 and l2 and l3 < l2:
        warnings.append(f"L3 ({l3} tokens) is smaller than L2 ({l2} tokens): it cannot hold what L2 evicts")
    if l3 and not enable_hierarchical_cache:
        warnings.append("an L3 tier needs --enable-hierarchical-cache (L2 stages every L3 read and write)")
    return {
        "bytes_per_token": bytes_per_token,
        "page_size": page_size,
        "l1_tokens": l1,
        "l1_bytes": l1 * bytes_per_token,
        "l2_tokens": l2,
        "l2_bytes": l2 * bytes_per_token,
        "host_ram_left_bytes": ram_left,
        "l3_tokens": l3,
        "l3_bytes": l3 * bytes_per_token,
        "warnings": warnings,
    }


def recorded_requests_ingest(*, worker, requests: list[dict], block_tokens: int = 512) -> int:
    """Store a batch of a worker's trace rows (already validated; ``block_tokens`` tokens per hash id)
    under its pool; returns how many."""
    from controlplane.capacity.models import RecordedRequest
    from controlplane.telemetry.selectors import POOLS

    pool = POOLS.get(worker.role, worker.role)
    RecordedRequest.objects.bulk_create(
        RecordedRequest(
            worker=worker,
            pool=pool,
            timestamp_ms=r["timestamp"],
            input_length=r["input_length"],
            output_length=r["output_length"],
            hash_ids=r["hash_ids"],
            output_hash_ids=r.get("output_hash_ids") or [],
            misses=r.get("misses") or {},
            block_tokens=block_tokens,
        )
        for r in requests
    )
    return len(requests)


SKIPPED = "skipped sweep points: "  # the CLI's stderr line for sweep points it cannot replay


def whatif_run(*, trace_text: str, options: list[str], timeout_s: float) -> tuple[list[dict], list[str]]:
    """Replay ``trace_text`` (Mooncake JSONL) with ``python -m engine.whatif`` ``options`` + ``--json``.

    The engine's CLI runs as a child process (the control plane never imports the engine). Returns one dict
    per capacity point, and why the sweep points the CLI skipped cannot be replayed (e.g. L2 not larger
    than L1). Raises ``ApplicationError`` ``whatif_failed``: 400 with the CLI's message for a bad
    trace or option, 504 past ``timeout_s``.
    """
    import json
    import subprocess
    import sys
    import tempfile

    from django.conf import settings

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", prefix="kvfleet-whatif-") as f:
        f.write(trace_text)
        f.flush()
        argv = [sys.executable, "-m", "engine.whatif", f.name, *options, "--json", "--no-ttft"]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout_s, cwd=settings.BASE_DIR
            )
        except subprocess.TimeoutExpired:
            message = f"the replay took longer than {timeout_s:.0f} s: sweep fewer points"
            raise ApplicationError(message, code="whatif_failed", status_code=504) from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["the replay failed"])[-1]
        raise ApplicationError(last.replace(f.name, "trace").split("error: ", 1)[-1], code="whatif_failed")
    points = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    skipped = [line[len(SKIPPED) :] for line in done.stderr.splitlines() if line.startswith(SKIPPED)]
    return points, skipped
