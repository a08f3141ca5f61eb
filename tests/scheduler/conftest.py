"""Fixtures for the scheduler tests: the real scheduler and cache, a fake runner in place of the model."""

from __future__ import annotations

import pytest
from scheduler_testlib import FakeModelRunner

from engine.cache.config import HiCacheConfig
from engine.cache.device_pool import DeviceKVPool
from engine.cache.hiradix_cache import HiRadixCache
from engine.scheduler import Scheduler, SchedulerConfig


@pytest.fixture
def make_scheduler():
    """``make_scheduler(device_tokens=..., **SchedulerConfig fields)`` -> (scheduler, fake runner), not
    started (submit requests first to have them in one inbox drain). Stopped at teardown."""
    made: list[Scheduler] = []

    def make(device_tokens: int = 256, page_size: int = 4, **config):
        pool = DeviceKVPool(device_tokens, page_size, 1, 1, 4)
        cache = HiRadixCache(pool, HiCacheConfig(), model_name="m", enable_hierarchical=False)
        runner = FakeModelRunner()
        sched = Scheduler(runner, cache, pool, SchedulerConfig(context_length=512, **config), lambda ids: "")
        made.append(sched)
        return sched, runner

    yield make
    for sched in made:
        sched.stop()
