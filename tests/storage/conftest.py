"""Fixtures for the L3 storage tests.

``PageBufferPool`` is a TEST DOUBLE of the contracted host pool (engine/cache/host_pool.py
``HostKVPool``, owned by the cache engineer): it provides only what storage backends use (``layout``,
``page_size``, ``dtype``, ``size``, ``kv_buffer``, ``page_bytes``, ``get_flat_data_page``,
``set_from_flat_data_page``, ``get_page_buffer_views``) with the spec §4 shapes. It is replaced by the
real HostKVPool once that lands.
"""

from __future__ import annotations

import pytest
import torch

from engine.cache.storage.base import HiCacheStorageConfig


class PageBufferPool:
    """Test double of HostKVPool: MHA host buffer in one of the three layouts (hicache-spec §4)."""

    def __init__(self, size, page_size, num_layers, num_kv_heads, head_dim, dtype, layout):
        self.size, self.page_size, self.dtype, self.layout = size, page_size, dtype, layout
        self.num_layers = num_layers
        n, p, lyr, h, d = size, page_size, num_layers, num_kv_heads, head_dim
        shape = {
            "layer_first": (2, lyr, n, h, d),
            "page_first": (2, n, lyr, h, d),
            "page_first_direct": (2, n // p, lyr, p, h, d),
        }[layout]
        self.kv_buffer = torch.zeros(shape, dtype=dtype)
        self.page_bytes = 2 * lyr * p * h * d * dtype.itemsize

    def get_page_buffer_views(self, first_slot: int) -> list[torch.Tensor]:
        s, p = first_slot, self.page_size
        if self.layout == "layer_first":
            return [
                self.kv_buffer[kv, layer, s : s + p] for kv in range(2) for layer in range(self.num_layers)
            ]
        if self.layout == "page_first":
            return [self.kv_buffer[kv, s : s + p] for kv in range(2)]
        return [self.kv_buffer[kv, s // p] for kv in range(2)]

    def get_flat_data_page(self, first_slot: int) -> torch.Tensor:
        return torch.cat([v.reshape(-1) for v in self.get_page_buffer_views(first_slot)])

    def set_from_flat_data_page(self, first_slot: int, data: torch.Tensor) -> None:
        offset = 0
        for view in self.get_page_buffer_views(first_slot):
            view.copy_(data[offset : offset + view.numel()].view(view.shape))
            offset += view.numel()

    def fill_random(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=gen).to(self.dtype))


def make_pool(layout="page_first", page_size=4, pages=8, dtype=torch.float16, layers=3, heads=2, dim=8):
    return PageBufferPool(pages * page_size, page_size, layers, heads, dim, dtype, layout)


def make_config(layout="page_first", page_size=4, dtype="float16", extra=None, **kw) -> HiCacheStorageConfig:
    fields = dict(tp_rank=0, tp_size=1, is_mla_model=False, model_name="test-model")
    fields.update(kw)
    return HiCacheStorageConfig(
        page_size=page_size, kv_dtype=dtype, layout=layout, extra_config=dict(extra or {}), **fields
    )


@pytest.fixture
def page_pool_factory():
    return make_pool


@pytest.fixture
def storage_config_factory():
    return make_config
