"""Fixtures for the cache tests (helpers live in cache_testlib.py)."""

from __future__ import annotations

import pytest
from cache_testlib import HEAD_DIM, HEADS, LAYERS

from engine.cache.config import HiCacheConfig
from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import HiRadixCache


@pytest.fixture
def make_cache():
    """Factory for small caches (page size 4, 2 layers); every cache is closed after the test."""
    caches: list[HiRadixCache] = []

    def make(
        device_tokens: int = 64,
        page_size: int = 4,
        *,
        hierarchical: bool = True,
        model_name: str = "m",
        tenant_caps=None,
        **cfg,
    ) -> HiRadixCache:
        cfg.setdefault("ratio", 4.0)
        pool = DeviceKVPool(device_tokens, page_size, LAYERS, HEADS, HEAD_DIM)
        cache = HiRadixCache(
            pool,
            HiCacheConfig(**cfg),
            model_name=model_name,
            enable_hierarchical=hierarchical,
            tenant_caps=tenant_caps,
        )
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        cache.close()
