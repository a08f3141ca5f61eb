"""Upstream SGLang launch flags KVFleet does not implement, and the mistaken spellings users type.

The one place that knows these names. ``python -m engine.launch_server`` asks :func:`explain` about every
flag its parser does not know: a flag of SGLang's ``launch_server`` that KVFleet leaves out is "not supported
by KVFleet" (not "unrecognized"), a flag planned for a later release says "yet", and a common wrong
spelling names the real flag(s). Anything else falls back to the closest real flags
(:mod:`engine.unknown_flags`).
"""

from __future__ import annotations

NOT_YET: dict[str, str] = {}
"""Upstream flags a later KVFleet release implements: flag -> why it is refused today."""

UNSUPPORTED: tuple[str, ...] = (
    # model and tokenizer
    "--tokenizer-path",
    "--tokenizer-mode",
    "--skip-tokenizer-init",
    "--load-format",
    "--model-loader-extra-config",
    "--trust-remote-code",
    "--revision",
    "--model-impl",
    "--is-embedding",
    "--json-model-override-args",
    "--download-dir",
    "--chat-template",
    "--completion-template",
    # quantization and data types
    "--quantization",
    "--quantization-param-path",
    # memory and scheduling
    "--cpu-offload-gb",
    "--schedule-policy",
    "--schedule-conservativeness",
    "--enable-mixed-chunk",
    "--stream-interval",
    "--stream-output",
    "--disable-radix-cache",
    "--disable-chunked-prefix-cache",
    "--enable-priority-scheduling",
    # parallelism (besides tensor and DP attention; --ep-size a real flag)
    "--pp-size",
    "--pipeline-parallel-size",
    "--nccl-port",
    "--gpu-id-step",
    # kernels and backends
    "--sampling-backend",
    "--mm-attention-backend",
    "--prefill-attention-backend",
    "--decode-attention-backend",
    "--moe-runner-backend",
    "--disable-cuda-graph",
    "--cuda-graph-max-bs",
    "--cuda-graph-bs",
    "--enable-torch-compile",
    "--torch-compile-max-bs",
    "--disable-overlap-schedule",
    "--triton-attention-num-kv-splits",
    "--enable-deterministic-inference",
    # speculative decoding and LoRA
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
    "--enable-lora",
    "--lora-paths",
    "--max-loras-per-batch",
    "--max-lora-rank",
    "--lora-backend",
    # API and logging
    "--reasoning-parser",
    "--allow-auto-truncate",
    "--file-storage-path",
    "--log-requests",
    "--log-requests-level",
    "--show-time-cost",
    "--decode-log-interval",
    "--crash-dump-folder",
    "--collect-tokens-histogram",
    "--bucket-time-to-first-token",
    "--bucket-inter-token-latency",
    "--bucket-e2e-request-latency",
    "--skip-server-warmup",
    "--warmups",
    "--enable-p2p-check",
    # HiCache and disaggregation options beyond KVFleet's
    "--hicache-host-memory-mode",
    "--disable-hicache-numa-detect",
    "--disaggregation-decode-tp",
    "--disaggregation-decode-dp",
    "--disaggregation-prefill-pp",
    "--enable-lmcache",
)
"""SGLang ``launch_server`` flags KVFleet leaves out (the common ones; a typo of one still gets the
closest real flags)."""

MISTAKEN: dict[str, tuple[str, ...]] = {
    "--enable-hicache": ("--enable-hierarchical-cache",),
    "--hicache": ("--enable-hierarchical-cache",),
    "--enable-hierarchical-kv-cache": ("--enable-hierarchical-cache",),
    "--hicache-mem-pool-size": ("--hicache-size", "--hicache-ratio"),
    "--hicache-pool-size": ("--hicache-size", "--hicache-ratio"),
    "--hicache-host-size": ("--hicache-size", "--hicache-ratio"),
    "--host-mem-pool-size": ("--hicache-size", "--hicache-ratio"),
    "--hicache-storage": ("--hicache-storage-backend",),
    "--storage-backend": ("--hicache-storage-backend",),
    "--kv-cache-size": ("--max-total-tokens",),
    "--max-num-seqs": ("--max-running-requests",),
    "--max-model-len": ("--context-length",),
    "--gpu-memory-utilization": ("--mem-fraction-static",),
    "--model-name": ("--served-model-name",),
    "--seed": ("--random-seed",),
}
"""Spellings from other engines or older docs -> the KVFleet flags that do that job."""


def explain(flag: str) -> str | None:
    """Why ``flag`` (``--name``, without ``=value``) is refused, when it is a known upstream or mistaken
    flag; ``None`` otherwise (the caller then suggests the closest real flags)."""
    if flag in NOT_YET:
        return f"{flag} is not supported by KVFleet yet ({NOT_YET[flag]})"
    if flag in UNSUPPORTED:
        return f"{flag} is an SGLang flag not supported by KVFleet"
    if flag in MISTAKEN:
        return f"unrecognized argument {flag}: use {' or '.join(MISTAKEN[flag])}"
    return None
