"""Fixtures for the L3 storage tests: real host pools (engine.cache.host_pool.HostKVPool) and configs."""

from __future__ import annotations

import pytest
import torch

from engine.cache.host_pool import HostKVPool
from engine.cache.storage.base import HiCacheStorageConfig


def make_pool(
    layout="page_first", page_size=4, pages=8, dtype=torch.float16, layers=3, heads=2, dim=8, seed=None
):
    """A small real host pool; ``seed`` fills its buffer with random values."""
    pool = HostKVPool(pages * page_size, page_size, layers, heads, dim, dtype, layout, pin_memory=False)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(dtype))
    return pool


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
