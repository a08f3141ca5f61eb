"""KV page transfer: one Triton kernel moving a batch of pages between two paged KV buffers.

Follows upstream's GPU-assisted HiCache io (``transfer_kv_per_layer`` / ``transfer_kv_all_layer``,
docs/upstream.md H4): the GPU reads and writes pinned host memory directly, so a whole batch of scattered
pages moves in one launch instead of one copy per page. Every layout here (the L1 device pool and the three L2
host layouts) stores one token of one layer of K (or V) as a contiguous row of ``H * D`` elements, so a buffer
is described by four strides, in elements: between K and V, layers, pages and tokens inside a page
(:class:`PagedKV`). The kernel copies bits: buffers are reinterpreted as the widest integer type dividing a
row (8, 4, 2 or 1 bytes), so fp16, bf16 and fp32 move alike.

Grid: ``(pages, 2 * layers)``; program ``(i, j)`` copies page ``src_pages[i]`` of layer ``first + j // 2``,
K if ``j`` is even else V, to page ``dst_pages[i]``, in blocks of ``BLOCK`` elements (any page size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import jit

_INT_BY_WIDTH = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
MAX_BLOCK = 4096


@dataclass(frozen=True)
class PagedKV:
    """A paged K/V buffer as the kernel sees it.

    ``data``: the whole buffer as a 1-D integer tensor (a view, no copy); ``kv``, ``layer``, ``page``,
    ``token``: strides in ``data`` elements between K and V, layers, pages and the tokens of one page;
    ``row``: elements per token row (``H * D`` of the source dtype, counted in ``data`` elements).
    """

    data: torch.Tensor
    kv: int
    layer: int
    page: int
    token: int
    row: int

    @classmethod
    def from_strides(
        cls, buffer: torch.Tensor, kv: int, layer: int, page: int, token: int, row: int
    ) -> PagedKV:
        """``buffer`` (contiguous, any dtype) with strides and ``row`` in its own elements, reinterpreted
        as the widest integer that divides the row bytes. Raises ``ValueError`` for a non-contiguous
        buffer."""
        if not buffer.is_contiguous():
            raise ValueError("paged KV buffer must be contiguous")
        row_bytes = row * buffer.element_size()
        width = next(w for w in _INT_BY_WIDTH if row_bytes % w == 0 and buffer.data_ptr() % w == 0)
        scale = buffer.element_size()
        flat = buffer.reshape(-1).view(torch.uint8).view(_INT_BY_WIDTH[width])

        def conv(stride: int) -> int:
            return stride * scale // width

        return cls(flat, conv(kv), conv(layer), conv(page), conv(token), row_bytes // width)


def layout_strides(layout: str, num_layers: int, num_tokens: int, page_size: int, row: int) -> dict:
    """Element strides ``{kv, layer, page, token}`` of a buffer of ``num_tokens`` token slots.

    ``layer_first`` ``(2, L, N, H, D)`` (also the L1 device pool), ``page_first`` ``(2, N, L, H, D)``,
    ``page_first_direct`` ``(2, N / P, L, P, H, D)``. Raises ``ValueError`` for another layout.
    """
    L, N, P = num_layers, num_tokens, page_size
    if layout == "layer_first":
        return {"kv": L * N * row, "layer": N * row, "page": P * row, "token": row}
    if layout == "page_first":
        return {"kv": N * L * row, "layer": row, "page": P * L * row, "token": L * row}
    if layout == "page_first_direct":
        return {"kv": N * L * row, "layer": P * row, "page": L * P * row, "token": row}
    raise ValueError(f"unsupported KV layout {layout!r}")


@jit
def _copy_pages_kernel(
    src,
    dst,
    src_pages,
    dst_pages,
    src_kv,
    src_layer,
    src_page,
    src_token,
    dst_kv,
    dst_layer,
    dst_page,
    dst_token,
    first_layer,
    ROW: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    j = tl.program_id(1)
    layer = (first_layer + j // 2).to(tl.int64)
    kv = (j % 2).to(tl.int64)
    sp = tl.load(src_pages + i).to(tl.int64)
    dp = tl.load(dst_pages + i).to(tl.int64)
    src_base = src + kv * src_kv + layer * src_layer + sp * src_page
    dst_base = dst + kv * dst_kv + layer * dst_layer + dp * dst_page
    for start in range(0, PAGE * ROW, BLOCK):
        off = start + tl.arange(0, BLOCK)
        mask = off < PAGE * ROW
        tok = off // ROW
        col = off % ROW
        values = tl.load(src_base + tok * src_token + col, mask=mask)
        tl.store(dst_base + tok * dst_token + col, values, mask=mask)


def copy_pages(
    src: PagedKV,
    dst: PagedKV,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    page_size: int,
    first_layer: int,
    num_layers: int = 1,
) -> None:
    """Copy K and V of pages ``src_pages[i]`` -> ``dst_pages[i]`` for layers ``first_layer ..
    first_layer + num_layers - 1`` in one launch.

    ``src_pages``/``dst_pages``: int64 ``(n,)`` page numbers (not slots) on the launch device; repeats in
    ``src_pages`` are allowed, ``dst_pages`` must not repeat (the copies would race). Either buffer may be
    pinned host memory when launching on CUDA. Raises ``ValueError`` for different row widths or lengths.
    """
    if src.row != dst.row or src.data.dtype != dst.data.dtype:
        raise ValueError(f"rows differ: {src.row} x {src.data.dtype} vs {dst.row} x {dst.data.dtype}")
    if src_pages.shape != dst_pages.shape:
        raise ValueError(f"{src_pages.shape[0]} source pages for {dst_pages.shape[0]} destination pages")
    n = src_pages.shape[0]
    if n == 0 or num_layers == 0:
        return
    block = min(triton.next_power_of_2(page_size * src.row), MAX_BLOCK)
    _copy_pages_kernel[(n, 2 * num_layers)](
        src.data,
        dst.data,
        src_pages,
        dst_pages,
        src.kv,
        src.layer,
        src.page,
        src.token,
        dst.kv,
        dst.layer,
        dst.page,
        dst.token,
        first_layer,
        ROW=src.row,
        PAGE=page_size,
        BLOCK=block,
    )
