"""``--hicache-io-backend kernel`` (upstream's default) on a CPU pool without ``TRITON_INTERPRET=1``:
corrected to ``direct`` with a logged warning, upstream's layout rules applied after the correction, and the
cache works on the result. (The kernel backend itself is tested under the interpreter in tests/kernels.)"""

from __future__ import annotations

import logging

import pytest
from cache_testlib import assert_kv, check_invariants, prefill, scribble_free_device_slots

from engine.cache.io_backends import KernelIO, resolve_layout

T = list(range(1, 41))  # 10 pages of 4


@pytest.fixture(autouse=True)
def no_triton_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize(
    ("layout", "storage", "expected"),
    [
        ("layer_first", None, "layer_first"),
        ("page_first", None, "page_first_direct"),  # kernel -> direct, then page_first + direct rule
        ("page_first_direct", None, "page_first_direct"),
        ("layer_first", "mooncake", "page_first_direct"),  # kernel -> direct, then the mooncake rule
        ("layer_first", "file", "layer_first"),
    ],
)
def test_kernel_is_corrected_to_direct_with_a_warning(caplog, layout, storage, expected):
    with caplog.at_level(logging.WARNING, logger="engine.cache.io_backends"):
        assert resolve_layout(layout, "kernel", storage) == (expected, "direct")
    messages = _warnings(caplog)
    assert any("kernel io backend is not available" in m and "direct" in m for m in messages), messages
    if expected != layout:
        assert any(m.endswith(expected) for m in messages), messages


def test_direct_is_never_corrected(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.cache.io_backends"):
        assert resolve_layout("layer_first", "direct", None) == ("layer_first", "direct")
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    ("layout", "expected"), [("layer_first", "layer_first"), ("page_first", "page_first_direct")]
)
def test_cache_built_with_kernel_runs_direct_and_round_trips_kv(make_cache, caplog, layout, expected):
    with caplog.at_level(logging.WARNING, logger="engine.cache.io_backends"):
        cache = make_cache(device_tokens=64, io_backend="kernel", mem_layout=layout)
    assert (cache.config.io_backend, cache.config.mem_layout) == ("direct", expected)
    assert cache.host_pool.layout == expected
    status = cache.storage_status()
    assert status["hicache_io_backend"] == "direct"
    assert any("kernel io backend is not available" in m for m in _warnings(caplog))

    prefill(cache, T)
    cache.drain_io()  # write-through copy L1 -> L2
    assert cache.evict(len(T)) == len(T)
    scribble_free_device_slots(cache)
    m = cache.match_prefix(T)
    assert m.host_hit_length == len(T)
    device, _ = cache.init_load_back(m.last_host_node)
    cache.drain_io()
    assert_kv(cache.device_pool, T, device)
    check_invariants(cache)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_kernel_under_the_interpreter_keeps_its_layout_and_round_trips_kv(
    make_cache, monkeypatch, caplog, layout
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level(logging.WARNING, logger="engine.cache.io_backends"):
        cache = make_cache(device_tokens=64, io_backend="kernel", mem_layout=layout)
    assert (cache.config.io_backend, cache.config.mem_layout) == ("kernel", layout)
    assert isinstance(cache.controller.io, KernelIO) and cache.host_pool.layout == layout
    assert _warnings(caplog) == []

    prefill(cache, T)
    cache.drain_io()  # write-through: one kernel launch for all layers
    assert cache.evict(len(T)) == len(T)
    scribble_free_device_slots(cache)
    m = cache.match_prefix(T)
    device, _ = cache.init_load_back(m.last_host_node)
    cache.drain_io()  # load-back: one launch per layer
    assert_kv(cache.device_pool, T, device)
    check_invariants(cache)


def test_kernel_with_mooncake_switches_layer_first_to_page_first(monkeypatch, caplog):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with caplog.at_level(logging.WARNING, logger="engine.cache.io_backends"):
        assert resolve_layout("layer_first", "kernel", "mooncake") == ("page_first", "kernel")
    assert any(m.endswith("page_first") for m in _warnings(caplog))
