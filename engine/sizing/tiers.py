"""Per-tier KV capacity in tokens from the launch flags and the machine, as a worker would allocate it.

``l1_pool_tokens`` is the function the engine's builder sizes its L1 pool with (SGLang semantics:
``--max-total-tokens`` when given; else ``--mem-fraction-static`` (default 0.88) of the free GPU memory
after the weights on cuda; ``CPU_DEFAULT_MAX_TOTAL_TOKENS`` on cpu; rounded down to whole pages, at least
one page). L2 follows :func:`engine.cache.host_pool.requested_host_tokens` (``--hicache-size`` GB or
``--hicache-ratio`` x L1, rounded up to whole pages) and the engine's start-up checks become warnings
here. L3 is its byte size in whole pages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384
DEFAULT_MEM_FRACTION_STATIC = 0.88
HIGH_MEM_FRACTION = 0.92  # above this, activations and CUDA graphs have too little room on the GPU


def l1_pool_tokens(
    page_size: int,
    bytes_per_token: int,
    *,
    max_total_tokens: int | None = None,
    mem_fraction_static: float | None = None,
    free_gpu_bytes: int | None = None,
) -> int:
    """L1 tokens: ``max_total_tokens``, else ``free_gpu_bytes * mem_fraction_static // bytes_per_token``
    (``free_gpu_bytes`` None = a cpu worker: ``CPU_DEFAULT_MAX_TOTAL_TOKENS``), in whole pages, >= 1 page."""
    if max_total_tokens is not None:
        tokens = max_total_tokens
    elif free_gpu_bytes is not None:
        tokens = int(free_gpu_bytes * (mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC)) // bytes_per_token
    else:
        tokens = CPU_DEFAULT_MAX_TOTAL_TOKENS
    return max(page_size, tokens // page_size * page_size)


def dp_rank_pool_tokens(l1_tokens: int, dp_size: int, page_size: int) -> int:
    """One DP-attention rank's L1 tokens: the worker's ``l1_tokens`` split over ``dp_size`` ranks sharing
    one device, in whole pages, at least one."""
    return max(page_size, l1_tokens // dp_size // page_size * page_size)


@dataclass
class TierSizing:
    """Sizes in tokens and bytes; ``l2_tokens`` 0 without ``--enable-hierarchical-cache``."""

    bytes_per_token: int
    page_size: int
    l1_tokens: int
    l1_bytes: int
    l2_tokens: int
    l2_bytes: int
    host_ram_left_bytes: int | None
    l3_tokens: int
    l3_bytes: int
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def size_tiers(
    bytes_per_token: int,
    page_size: int,
    *,
    max_total_tokens: int | None = None,
    mem_fraction_static: float | None = None,
    free_gpu_bytes: int | None = None,
    enable_hierarchical_cache: bool = False,
    hicache_ratio: float = 2.0,
    hicache_size: float = 0,
    host_available_bytes: int | None = None,
    l3_bytes: int = 0,
) -> TierSizing:
    """Every tier's capacity and the warnings a worker started this way would deserve.

    Warnings: ``--mem-fraction-static`` above 0.92 (little GPU memory left for activations); a host pool
    not larger than L1 or one that does not fit in ``host_available_bytes`` minus the engine's reserve
    (the engine refuses to start, upstream's would swap); an L3 smaller than L2. Raises ``ValueError``
    naming the flag for a non-positive page size, bytes per token or negative size.
    """
    if page_size < 1:
        raise ValueError(f"--page-size must be >= 1, got {page_size}")
    if bytes_per_token < 1:
        raise ValueError(f"bytes per token must be >= 1, got {bytes_per_token}")
    for flag, value in (("--max-total-tokens", max_total_tokens), ("--l3-bytes", l3_bytes)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    warnings = []
    l1 = l1_pool_tokens(
        page_size,
        bytes_per_token,
        max_total_tokens=max_total_tokens,
        mem_fraction_static=mem_fraction_static,
        free_gpu_bytes=free_gpu_bytes,
    )
    if max_total_tokens is not None and max_total_tokens % page_size:
        warnings.append(f"--max-total-tokens {max_total_tokens} is not a multiple of --page-size {page_size}")
    if max_total_tokens is None and free_gpu_bytes is not None:
        fraction = mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
        if fraction > HIGH_MEM_FRACTION:
            warnings.append(
                f"--mem-fraction-static {fraction} leaves {(1 - fraction):.0%} of free GPU memory for "
                "activations and CUDA graphs: expect out-of-memory under load (0.85-0.9 is usual)"
            )
    l2 = ram_left = None
    if enable_hierarchical_cache:
        # imported here: the pool module loads torch, and launch_server reads this module's constants
        # before it parses its flags
        from engine.cache.host_pool import GIB, host_memory_reserve, requested_host_tokens

        l2 = requested_host_tokens(l1, page_size, bytes_per_token, hicache_ratio, hicache_size)
        if l2 <= l1:
            warnings.append(
                f"host pool ({l2} tokens) is not larger than L1 ({l1} tokens): the engine refuses to start; "
                "raise --hicache-ratio above 1 or --hicache-size"
            )
        if host_available_bytes is not None:
            ram_left = host_available_bytes - l2 * bytes_per_token
            reserve = host_memory_reserve(host_available_bytes)
            if ram_left < reserve:
                need_gib, avail_gib = l2 * bytes_per_token / GIB, host_available_bytes / GIB
                warnings.append(
                    f"host pool needs {need_gib:.2f} GiB of {avail_gib:.2f} GiB available, leaving less "
                    f"than the {reserve / GIB:.2f} GiB reserve: it would swap (the engine refuses to "
                    "start); lower --hicache-ratio or --hicache-size"
                )
    l3 = l3_bytes // (page_size * bytes_per_token) * page_size
    if l3 and l2 and l3 < l2:
        warnings.append(f"L3 ({l3} tokens) is smaller than L2 ({l2} tokens): it cannot hold what L2 evicts")
    if l3 and not enable_hierarchical_cache:
        warnings.append("an L3 tier needs --enable-hierarchical-cache (L2 stages every L3 read and write)")
    l2 = l2 or 0
    return TierSizing(
        bytes_per_token,
        page_size,
        l1,
        l1 * bytes_per_token,
        l2,
        l2 * bytes_per_token,
        ram_left,
        l3,
        l3 * bytes_per_token,
        warnings,
    )
