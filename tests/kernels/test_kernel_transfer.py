"""The KV page transfer kernel (interpreted) against torch indexing of the same buffers.

Random page indices with repeats across calls and scattered destinations, every host layout, both
directions, page sizes 1/16/64, fp16/bf16/fp32, one layer and all layers per launch; destinations are
pre-filled with NaN so an element the kernel misses fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

from kernels.transfer import PagedKV, copy_pages, layout_strides

LAYERS, HEADS, HEAD_DIM = 2, 2, 8
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
SHAPES = {
    "layer_first": lambda L, N, P: (2, L, N, HEADS, HEAD_DIM),
    "page_first": lambda L, N, P: (2, N, L, HEADS, HEAD_DIM),
    "page_first_direct": lambda L, N, P: (2, N // P, L, P, HEADS, HEAD_DIM),
}


def _page(buffer: torch.Tensor, layout: str, page: int, P: int) -> torch.Tensor:
    """Page ``page`` of ``buffer`` as ``(2, L, P, H, D)`` (torch reference view)."""
    if layout == "layer_first":
        return buffer[:, :, page * P : (page + 1) * P]
    if layout == "page_first":
        return buffer[:, page * P : (page + 1) * P].transpose(1, 2)
    return buffer[:, page]


def _paged(buffer: torch.Tensor, layout: str, P: int) -> PagedKV:
    tokens = buffer[0].numel() // (LAYERS * HEADS * HEAD_DIM)
    row = HEADS * HEAD_DIM
    return PagedKV.from_strides(buffer, **layout_strides(layout, LAYERS, tokens, P, row), row=row)


def _filled(shape, dtype, nan: bool) -> torch.Tensor:
    if nan:
        return torch.full(shape, float("nan"), dtype=dtype)
    return torch.randn(shape, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_move_both_ways_in_every_layout(layout, page_size, dtype):
    P, dev_pages, host_pages = page_size, 8, 10
    gen = torch.Generator().manual_seed(page_size)
    device = _filled(SHAPES["layer_first"](LAYERS, dev_pages * P, P), dtype, nan=False)
    host = _filled(SHAPES[layout](LAYERS, host_pages * P, P), dtype, nan=True)
    dev_kv, host_kv = _paged(device, "layer_first", P), _paged(host, layout, P)

    # L1 -> L2, all layers in one launch; two calls whose source pages repeat, scattered destinations
    written: dict[int, int] = {}
    for dst in (
        torch.randperm(host_pages, generator=gen)[:3],
        torch.randperm(host_pages, generator=gen)[3:7],
    ):
        src = torch.randint(0, dev_pages, (len(dst),), generator=gen)
        src[-1] = src[0]  # a repeated source page within the call
        copy_pages(dev_kv, host_kv, src, dst, P, 0, LAYERS)
        written.update(zip(dst.tolist(), src.tolist(), strict=True))
    for h, d in written.items():
        assert torch.equal(_page(host, layout, h, P), _page(device, "layer_first", d, P)), (h, d)
    untouched = set(range(host_pages)) - set(written)
    assert all(_page(host, layout, h, P).isnan().all() for h in untouched)

    # L2 -> L1, one layer per launch, into NaN-filled scattered device pages
    device.fill_(float("nan"))
    hosts = torch.tensor(sorted(written))
    dests = torch.randperm(dev_pages, generator=gen)[: len(hosts)]
    for layer in range(LAYERS):
        copy_pages(host_kv, dev_kv, hosts, dests, P, layer)
    for h, d in zip(hosts.tolist(), dests.tolist(), strict=True):
        assert torch.equal(_page(device, "layer_first", d, P), _page(host, layout, h, P)), (h, d)


def test_single_layer_launch_leaves_other_layers_alone():
    P = 4
    device = torch.randn(SHAPES["layer_first"](LAYERS, 4 * P, P))
    host = torch.full(SHAPES["page_first"](LAYERS, 4 * P, P), float("nan"))
    copy_pages(
        _paged(device, "layer_first", P),
        _paged(host, "page_first", P),
        torch.tensor([2]),
        torch.tensor([1]),
        P,
        1,
    )
    page = _page(host, "page_first", 1, P)
    assert torch.equal(page[:, 1], device[:, 1, 2 * P : 3 * P]) and page[:, 0].isnan().all()


def test_mismatched_rows_are_refused():
    a = _paged(torch.zeros(SHAPES["layer_first"](LAYERS, 8, 4)), "layer_first", 4)
    b = _paged(torch.zeros(SHAPES["layer_first"](LAYERS, 8, 4), dtype=torch.float16), "layer_first", 4)
    with pytest.raises(ValueError, match="rows differ"):
        copy_pages(a, b, torch.tensor([0]), torch.tensor([0]), 4, 0)
    with pytest.raises(ValueError, match="2 source pages for 1"):
        copy_pages(a, a, torch.tensor([0, 1]), torch.tensor([0]), 4, 0)
