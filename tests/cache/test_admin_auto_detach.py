"""The automatic L3 detach/re-attach on a real cache (``auto_detach_after_s`` in the extra config): the
breaker's clock is injected, the background probe runs on its real thread against a store that fails or
answers on demand. Absent key: never. A bad value: refused, naming the key, nothing changed."""

import json

import pytest
from cache_testlib import MemoryBackend, check_invariants, prefill

from engine.bench.outage import wait_for
from engine.cache.config import HiCacheConfig, split_extra_config
from engine.cache.hiradix_cache import CacheAdminError

T = list(range(1, 17))


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class FlakyStore(MemoryBackend):
    """A store that raises on every call while ``down`` (a master that went away)."""

    def __init__(self):
        super().__init__()
        self.down = False

    def set(self, key, value=None, target_location=None, target_sizes=None):
        if self.down:
            raise ConnectionError("store gone")
        return super().set(key, value)

    def exists(self, key):
        if self.down:
            raise ConnectionError("store gone")
        return super().exists(key)


def _extra(**keys) -> str:
    return json.dumps({"breaker_failures": 1, "breaker_open_s": 0.05, **keys})


def _attach_and_break(cache, extra: str) -> tuple[FlakyStore, Clock]:
    """Attach a store, inject the breaker's clock, take the store down and open the breaker by a backup."""
    store = FlakyStore()
    cache.storage.attach(store, extra)
    clock = Clock()
    cache.controller.health._clock = clock
    store.down = True
    prefill(cache, T)
    cache.drain_io()
    assert cache.controller.health.state == "open"
    return store, clock


def _reattached(cache, store) -> bool:
    cache.check_hicache_events()  # what the scheduler does every iteration
    return cache.storage.backend is store


def test_an_open_breaker_detaches_l3_after_the_allowed_time_and_a_probe_reattaches_it(make_cache):
    cache = make_cache()
    store, clock = _attach_and_break(cache, _extra(auto_detach_after_s=60))
    clock.now += 59.9
    cache.check_hicache_events()
    assert cache.storage.backend is store  # not yet
    clock.now += 0.1
    cache.check_hicache_events()
    assert cache.storage.backend is None
    status = cache.storage_status()
    assert status["hicache_storage_backend"] is None and status["auto_detach_after_s"] == 60
    assert status["auto_detach"]["detached"] and status["auto_detach"]["backend"] == "FlakyStore"
    health = cache.storage.health()  # still reported while out, under the kept backend's name
    assert health["storage_backend"] == "FlakyStore" and health["state"] == "open"
    assert health["auto_detach"]["detaches"] == 1

    prefill(cache, list(range(40, 48)))  # served without L3 meanwhile
    cache.drain_io()
    wait_for(lambda: cache.storage.auto.failed_probes >= 2, 10, "two failed background probes")
    assert cache.storage.backend is None and "store gone" in cache.storage.auto.last_probe_failure

    store.down = False
    wait_for(lambda: _reattached(cache, store), 10, "the store re-attached after a probe answered")
    cache.drain_io()  # the re-attach backs up every L2 page: 6 pages, 10% of them admitted (none whole)
    health = cache.storage.health()
    assert health["state"] == "closed" and health["ramp_share"] == 0.1  # the backup ramp starts
    assert store.pages == {} and health["dropped_backup_pages"] == 4 + 6
    assert health["auto_detach"]["attaches"] == 1 and not health["auto_detach"]["detached"]
    assert cache.storage_status()["hicache_storage_backend"] == "FlakyStore"
    assert json.loads(cache.storage.backend_status()["hicache_storage_backend_extra_config"]) == json.loads(
        _extra(auto_detach_after_s=60)
    )  # the same config
    clock.now += 10.0  # the ramp is over: every backup goes through again
    prefill(cache, list(range(60, 68)))
    cache.drain_io()
    assert len(store.pages) == 2
    check_invariants(cache)


def test_without_the_key_an_open_breaker_never_detaches(make_cache):
    cache = make_cache()
    store, clock = _attach_and_break(cache, _extra())
    for _ in range(3):
        clock.now += 3600.0
        cache.check_hicache_events()
    assert cache.storage.backend is store and cache.storage.auto is None
    assert cache.storage.health()["auto_detach"] is None
    assert cache.storage_status()["auto_detach"] is None


def test_an_operators_detach_while_out_ends_the_probing_and_closes_nothing_twice(make_cache):
    cache = make_cache()
    store, clock = _attach_and_break(cache, _extra(auto_detach_after_s=0))
    cache.check_hicache_events()
    assert cache.storage.backend is None and cache.storage.auto.kept is not None
    assert cache.storage.detach() == "Detached storage backend 'FlakyStore'"
    assert cache.storage.auto.kept is None and cache.storage.health() is None
    store.down = False
    for _ in range(3):
        cache.check_hicache_events()
    assert cache.storage.backend is None  # an operator's detach is final
    assert cache.storage.detach() == "no storage backend attached"


@pytest.mark.parametrize(
    ("value", "why"),
    [(-1, "auto_detach_after_s: must be >= 0, got -1"), ("soon", "auto_detach_after_s: must be a number")],
)
def test_a_bad_auto_detach_value_is_refused_naming_the_key_and_changes_nothing(make_cache, value, why):
    cache = make_cache()
    before = cache.storage_status()
    with pytest.raises(CacheAdminError, match=why):
        cache.storage.attach(FlakyStore(), _extra(auto_detach_after_s=value))
    assert cache.storage_status() == before and cache.storage.backend is None
    with pytest.raises(ValueError, match=why):
        split_extra_config(HiCacheConfig(), {"auto_detach_after_s": value})
    with pytest.raises(ValueError, match=why):
        HiCacheConfig(auto_detach_after_s=value)


def test_null_turns_it_off_and_a_number_turns_it_on():
    config, rest = split_extra_config(HiCacheConfig(), {"auto_detach_after_s": 30, "file_path": "/x"})
    assert config.auto_detach_after_s == 30 and rest == {"file_path": "/x"}
    config, _ = split_extra_config(config, {"auto_detach_after_s": None})
    assert config.auto_detach_after_s is None
