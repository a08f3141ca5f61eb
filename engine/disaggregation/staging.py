"""Moving a share of a page's KV heads between pools of different tp: per-head writes or a staging buffer.

A pool page is token-major: ``(page_size, num_kv_heads, row)``, so the heads a prefill rank sends to a decode
rank of another tp (``heads.HeadShare``) are ``page_size`` separate pieces of each page on both sides.

* Per-head writes: one transfer entry per token per K/V buffer per layer, straight between the pools
  (``head_write_list``): no copies, ``2 * layers * tokens`` small entries.
* Staging (``SGLANG_DISAGG_STAGING_BUFFER=1``): the prefill copies the share into one contiguous region of a
  registered staging buffer (``pack``), writes that region to the decode's staging buffer in one entry, and
  the decode copies it into its pages (``scatter``): two memory copies, one transfer entry. The region's
  layout is page-major, ``(pages, 2 * layers, page_size, n, row)`` (buffers: layer 0..L-1 keys, then
  values), so the pages of a later chunk of the prompt land at ``offset + pages_before * page_share``.

Neither applies to a share that is every head of both pools (``heads.HeadShare.whole``; always the case for
an MLA model's latent): it moves as whole pages, like equal tp. A PD worker of an MLA model refuses to
start with the staging buffer on (``mla_staging_refused``).
"""

from __future__ import annotations

import os
import threading

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation.base import KVLayout

DEFAULT_POOL_MB = 64  # SGLANG_DISAGG_STAGING_POOL_SIZE_MB when unset


def staging_enabled() -> bool:
    """``SGLANG_DISAGG_STAGING_BUFFER`` is ``1`` / ``true``: gather heads through a staging buffer."""
    return os.environ.get("SGLANG_DISAGG_STAGING_BUFFER", "").strip().lower() in ("1", "true", "yes")


def mla_staging_refused(architecture: str) -> str | None:
    """Why a PD worker of an MLA model (``architecture``) cannot start with ``SGLANG_DISAGG_STAGING_BUFFER``
    on, else None (the variable is off). The staging buffer gathers a share of KV heads sliced out of each
    token's row (GQA/MHA KV between different tp sizes); an MLA latent is one KV head every rank holds whole,
    so it is never sliced and always moves as whole pages (``heads.latent_shares``), as upstream keeps
    staging to non-MLA models."""
    if not staging_enabled():
        return None
    return (
        f"SGLANG_DISAGG_STAGING_BUFFER={os.environ['SGLANG_DISAGG_STAGING_BUFFER']}: the PD staging buffer "
        f"gathers KV heads sliced between different tp sizes (GQA/MHA KV only); {architecture} (MLA) keeps "
        "one latent every rank holds whole, which moves as whole pages from one prefill rank per decode "
        "rank; unset SGLANG_DISAGG_STAGING_BUFFER"
    )


def staging_pool_bytes() -> int:
    """``SGLANG_DISAGG_STAGING_POOL_SIZE_MB`` (default 64) in bytes; ``ValueError`` names the variable."""
    raw = os.environ.get("SGLANG_DISAGG_STAGING_POOL_SIZE_MB", "") or str(DEFAULT_POOL_MB)
    try:
        mb = int(raw)
    except ValueError:
        raise ValueError(f"SGLANG_DISAGG_STAGING_POOL_SIZE_MB={raw!r} is not an integer") from None
    if mb < 1:
        raise ValueError(f"SGLANG_DISAGG_STAGING_POOL_SIZE_MB must be >= 1, got {mb}")
    return mb << 20


def whole_share_mismatch(local: KVLayout, remote: KVLayout, share: dict) -> str | None:
    """Why a share marked ``whole`` (``heads.HeadShare.whole``: every head of both pools, as an MLA
    latent is) cannot move as whole pages between ``local`` and ``remote``, else None."""
    n = share["n"]
    if share["src_head"] or share["dst_head"] or not n == local.num_kv_heads == remote.num_kv_heads:
        return (
            f"a whole-page share of {n} KV heads from head {share['src_head']} to head {share['dst_head']} "
            f"does not cover both pools (prefill rank holds {local.num_kv_heads}, decode rank "
            f"{remote.num_kv_heads})"
        )
    return local.mismatch(remote)


def page_share_bytes(layout: KVLayout, n: int) -> int:
    """Bytes of ``n`` heads of one page over every K/V buffer."""
    return 2 * layout.num_layers * layout.page_size * n * layout.head_bytes


def share_bytes(layout: KVLayout, num_pages: int, n: int) -> int:
    """Bytes of ``n`` heads of ``num_pages`` pages over every K/V buffer (a staged region's size)."""
    return 2 * layout.num_layers * num_pages * layout.page_size * n * layout.head_bytes


def head_write_list(
    local: KVLayout,
    remote: KVLayout,
    src: torch.Tensor,
    dst: torch.Tensor,
    src_head: int,
    dst_head: int,
    n: int,
) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, byte lengths) writing local heads ``[src_head, +n)`` of pages
    ``src`` into remote heads ``[dst_head, +n)`` of pages ``dst`` (int64 ``(pages,)``): one entry per token
    per buffer."""
    ps, hb = local.page_size, local.head_bytes
    offs = torch.arange(ps, dtype=torch.int64)
    src_off = ((src[:, None] * ps + offs) * local.num_kv_heads + src_head).flatten() * hb
    dst_off = ((dst[:, None] * ps + offs) * remote.num_kv_heads + dst_head).flatten() * hb
    srcs: list[int] = []
    dsts: list[int] = []
    for s_base, d_base in zip((*local.k_ptrs, *local.v_ptrs), (*remote.k_ptrs, *remote.v_ptrs), strict=True):
        srcs += (src_off + s_base).tolist()
        dsts += (dst_off + d_base).tolist()
    return srcs, dsts, [n * hb] * len(srcs)


def _paged(pool: DeviceKVPool, buf: torch.Tensor) -> torch.Tensor:
    return buf.view(-1, pool.page_size, pool.num_kv_heads, buf.shape[-1])


def _region(pool: DeviceKVPool, data: torch.Tensor, pages: int, n: int) -> torch.Tensor:
    """``data`` (uint8) as the region of ``pages`` pages: ``(pages, 2 * layers, page_size, n, row)``."""
    shape = (pages, 2 * pool.num_layers, pool.page_size, n, pool.row_dim)
    size = pages * 2 * pool.num_layers * pool.page_size * n * pool.row_dim * pool.dtype.itemsize
    return data[:size].view(pool.dtype).view(shape)


def pack(pool: DeviceKVPool, out: torch.Tensor, src: torch.Tensor, src_head: int, n: int) -> int:
    """Copy heads ``[src_head, +n)`` of pages ``src`` of every buffer into ``out`` (uint8, at least
    ``share_bytes`` long) in the region layout; returns the bytes written."""
    region = _region(pool, out, len(src), n)
    for i, buf in enumerate((*pool.k_buffer, *pool.v_buffer)):
        region[:, i] = _paged(pool, buf)[src, :, src_head : src_head + n]
    return region.numel() * region.element_size()


def scatter(pool: DeviceKVPool, data: torch.Tensor, dst: torch.Tensor, dst_head: int, n: int) -> None:
    """Copy a region ``data`` (uint8, the layout ``pack`` writes) into heads ``[dst_head, +n)`` of pages
    ``dst`` of every buffer."""
    region = _region(pool, data, len(dst), n)
    for i, buf in enumerate((*pool.k_buffer, *pool.v_buffer)):
        _paged(pool, buf)[dst, :, dst_head : dst_head + n] = region[:, i]


class StagingArea:
    """A contiguous uint8 buffer of ``size`` bytes handed out in regions (first fit). ``alloc`` returns an
    offset or None when no gap is large enough; ``free`` gives a region back. Thread-safe."""

    def __init__(self, size: int) -> None:
        self.buffer = torch.zeros(size, dtype=torch.uint8)
        self.size = size
        self._used: dict[int, int] = {}  # offset -> size
        self._lock = threading.Lock()

    @property
    def ptr(self) -> int:
        return self.buffer.data_ptr()

    def alloc(self, nbytes: int) -> int | None:
        with self._lock:
            at = 0
            for start in sorted(self._used):
                if start - at >= nbytes:
                    break
                at = start + self._used[start]
            else:
                if self.size - at < nbytes:
                    return None
            self._used[at] = nbytes
            return at

    def free(self, offset: int) -> None:
        with self._lock:
            self._used.pop(offset, None)

    def region(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[offset : offset + nbytes]
