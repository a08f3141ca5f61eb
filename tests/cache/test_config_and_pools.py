"""Config parsing, host pool layouts and sizing, allocators, direct io copies (docs/upstream.md H4, H8)."""

import json
import logging

import pytest
import torch

from engine.cache.allocator import PageAllocator
from engine.cache.config import HiCacheConfig, parse_extra_config, split_extra_config
from engine.cache.device_pool import DeviceKVPool
from engine.cache.host_pool import GIB, HostKVPool, host_pool_tokens
from engine.cache.io_backends import DirectIO, resolve_layout

# -- config -------------------------------------------------------------------------------------------------


def test_defaults_follow_upstream():
    cfg = HiCacheConfig()
    assert (cfg.ratio, cfg.size, cfg.write_policy, cfg.io_backend) == (2.0, 0, "write_through", "direct")
    assert (cfg.prefetch_threshold, cfg.prefetch_timeout_base) == (256, 2.0)
    assert (cfg.prefetch_timeout_per_ki_token, cfg.prefetch_timeout_max) == (0.1, 30.0)
    assert cfg.eviction_policy == "lru" and cfg.storage_backend is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("write_policy", "write_around", "write_policy"),
        ("prefetch_policy", "eager", "prefetch_policy"),
        ("eviction_policy", "random", "eviction_policy"),
        ("l2_admission", "arc", "l2_admission"),
        ("ratio", 1.0, "ratio"),
        ("prefetch_threshold", "256", "prefetch_threshold"),
        ("prefetch_timeout_base", "2", "prefetch_timeout_base"),
    ],
)
def test_bad_config_values_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        HiCacheConfig(**{field: value})


def test_extra_config_from_json_toml_yaml_files(tmp_path):
    data = {"prefetch_threshold": 64, "file_path": "/x"}
    (tmp_path / "c.json").write_text(json.dumps(data))
    (tmp_path / "c.toml").write_text('prefetch_threshold = 64\nfile_path = "/x"\n')
    (tmp_path / "c.yaml").write_text("prefetch_threshold: 64\nfile_path: /x\n")
    (tmp_path / "c.yml").write_text("prefetch_threshold: 64\nfile_path: /x\n")
    for name in ("c.json", "c.toml", "c.yaml", "c.yml"):
        assert parse_extra_config(f"@{tmp_path / name}") == data
    assert parse_extra_config(json.dumps(data)) == data
    assert parse_extra_config(None) == {}


def test_extra_config_errors_name_the_file_or_key(tmp_path):
    (tmp_path / "c.ini").write_text("[x]")
    with pytest.raises(ValueError, match=r"Unsupported config file .*c\.ini"):
        parse_extra_config(f"@{tmp_path / 'c.ini'}")
    with pytest.raises(ValueError, match="missing.json"):
        parse_extra_config(f"@{tmp_path / 'missing.json'}")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        parse_extra_config(f"@{tmp_path / 'bad.yaml'}")
    with pytest.raises(ValueError, match="invalid JSON"):
        parse_extra_config("{not json")
    with pytest.raises(ValueError, match="prefetch_threshold"):
        split_extra_config(HiCacheConfig(), {"prefetch_threshold": "256"})
    with pytest.raises(ValueError, match="hicache_storage_pass_prefix_keys"):
        split_extra_config(HiCacheConfig(), {"hicache_storage_pass_prefix_keys": "yes"})


def test_split_extra_config_pops_hicache_keys():
    extra = {"prefetch_threshold": 64, "prefetch_timeout_max": 5, "file_path": "/x"}
    cfg, rest = split_extra_config(HiCacheConfig(), extra)
    assert (cfg.prefetch_threshold, cfg.prefetch_timeout_max) == (64, 5)
    assert rest == {"file_path": "/x"} and cfg.extra_config == rest
    assert "prefetch_threshold" in extra  # input untouched


# -- allocator ----------------------------------------------------------------------------------------------


def test_allocator_whole_pages_never_twice_and_double_free_raises():
    alloc = PageAllocator(4, 4, first_page=1)
    a = alloc.alloc(8)
    assert a.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    b = alloc.alloc(8)
    assert alloc.alloc(4) is None
    assert not set(a.tolist()) & set(b.tolist())
    with pytest.raises(ValueError, match="multiple of page_size"):
        alloc.alloc(6)
    alloc.free(a)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a)
    assert alloc.alloc(16) is None and alloc.available_size() == 8
    assert sorted(alloc.alloc(8).tolist()) == a.tolist()  # lowest free pages again


# -- host pool --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        ("layer_first", (2, 3, 16, 2, 5)),
        ("page_first", (2, 16, 3, 2, 5)),
        ("page_first_direct", (2, 4, 3, 4, 2, 5)),
    ],
)
def test_host_layout_shapes_flat_pages_and_views(layout, shape):
    pool = HostKVPool(16, 4, 3, 2, 5, torch.float32, layout)
    assert tuple(pool.kv_buffer.shape) == shape
    pool.kv_buffer.copy_(torch.randn(shape))
    flat = pool.get_flat_data_page(8)
    assert flat.numel() * 4 == pool.page_bytes
    views = pool.get_page_buffer_views(8)
    assert all(v.is_contiguous() for v in views)
    assert len(views) == (6 if layout == "layer_first" else 2)
    assert torch.equal(torch.cat([v.flatten() for v in views]), flat)
    views[0].fill_(7.0)  # views alias the buffer
    assert torch.equal(pool.get_flat_data_page(8)[:10], torch.full((10,), 7.0))
    pool.set_from_flat_data_page(0, flat)
    assert torch.equal(pool.get_flat_data_page(0), flat)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8_e5m2", "int8"])
def test_both_pools_and_the_sizing_describe_a_token_alike(kv_cache_dtype):
    """One KV shape (engine/cache/kv_shape.py): the device pool's is the sizing's for the same model and
    format, and a host pool made for it holds pages of exactly that many bytes in every layout."""
    from engine.sizing.kv import shape_for

    device = DeviceKVPool(64, 16, 3, 2, 8, torch.float32, kv_cache_dtype=kv_cache_dtype)
    assert device.kv_shape == shape_for(3, 2, 8, device.kv_cache_dtype)
    for layout in ("layer_first", "page_first", "page_first_direct"):
        host = HostKVPool.for_device(device, 64, layout)
        page = host.get_flat_data_page(16)
        assert host.page_bytes == page.numel() * page.element_size() == 16 * device.bytes_per_token
        assert host.kv_shape.bytes_per_token == device.bytes_per_token


def test_host_size_from_ratio_or_gb_and_checks():
    assert host_pool_tokens(100, 4, 1000, 2.0, 0) == 204
    assert host_pool_tokens(100, 4, 1000, 2.0, 0.001) == 1004  # 1e6 bytes / 1000 per token, page up
    with pytest.raises(ValueError, match=r"must be larger than the device pool"):
        host_pool_tokens(100, 4, 1000, 0.5, 0)
    with pytest.raises(
        ValueError, match=r"needs 18\.63 GiB but only .* GiB is usable \(16\.00 GiB available"
    ):
        host_pool_tokens(10**6, 4, 10_000, 2.0, 0, available_bytes=16 * GIB)


def test_layout_corrections_warn_and_refusals(caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_layout("page_first", "direct", None) == ("page_first_direct", "direct")
        assert resolve_layout("page_first_direct", "direct", None) == ("page_first_direct", "direct")
        assert resolve_layout("layer_first", "direct", "mooncake") == ("page_first_direct", "direct")
    assert len(caplog.records) == 2
    assert resolve_layout("layer_first", "direct", "file") == ("layer_first", "direct")
    with pytest.raises(ValueError, match="page_head"):
        resolve_layout("page_head", "direct", None)
    with pytest.raises(ValueError, match="hicache_io_backend"):
        resolve_layout("layer_first", "kernel_ascend", None)


# -- direct io ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["copy_pages", "torch"])
@pytest.mark.parametrize("host_order", ["runs", "scattered"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_direct_io_round_trip_any_page_order(layout, page_size, host_order, native):
    dev = DeviceKVPool(32, page_size, 2, 2, 3, torch.bfloat16)
    host = HostKVPool(64, page_size, 2, 2, 3, torch.bfloat16, layout)
    io = DirectIO(dev, host, native=native)
    assert io.native is native  # the venv builds the extension
    for layer in range(2):
        dev.k_buffer[layer].copy_(torch.randn_like(dev.k_buffer[layer], dtype=torch.float32))
        dev.v_buffer[layer].copy_(torch.randn_like(dev.v_buffer[layer], dtype=torch.float32))
    src = PageAllocator(32 // page_size, page_size, first_page=1).alloc(16)
    src = src.view(-1, page_size)[torch.randperm(16 // page_size)].flatten()  # scattered device pages
    if host_order == "runs":  # two runs of consecutive host pages
        slots = torch.cat([torch.arange(8), torch.arange(32, 40)])
    else:  # random pages: many runs, or the gather+scatter fallback
        pages = torch.randperm(64 // page_size)[: 16 // page_size]
        slots = (pages[:, None] * page_size + torch.arange(page_size)).flatten()
    if not native:  # torch's index ops: runs of host pages, gather + scatter when too fragmented
        assert (io.plan(src, slots)[2] is None) == (host_order == "scattered" and page_size == 1)
    io.backup(src, slots)
    expect = [(dev.k_buffer[i][src].clone(), dev.v_buffer[i][src].clone()) for i in range(2)]
    dst = torch.arange(page_size, page_size + 16)
    plan = io.plan(dst, slots)
    for layer in range(2):
        io.load_layer(layer, plan)
        assert torch.equal(dev.k_buffer[layer][dst], expect[layer][0])
        assert torch.equal(dev.v_buffer[layer][dst], expect[layer][1])


def _host_page(host: HostKVPool, kv: int, layer: int, page: int, buffer: torch.Tensor | None = None):
    """K (``kv`` 0) or V of ``layer`` in host page ``page`` of ``buffer`` (default the pool's), (P, H, D)."""
    buffer = host.kv_buffer if buffer is None else buffer
    P = host.page_size
    if host.layout == "layer_first":
        return buffer[kv, layer, page * P : (page + 1) * P]
    return buffer[kv, page, layer]


@pytest.mark.parametrize("native", [True, False], ids=["copy_pages", "torch"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize(
    ("heads", "head_dim"), [(2, 4), (4, 4099)], ids=["memcpy", "streamed"]
)  # streamed: over 1 MiB a layer, rows of 65,584 bytes (not 16-byte aligned)
def test_direct_io_merges_runs_only_where_both_sides_are_consecutive(layout, native, heads, head_dim):
    # Each pair of pages is consecutive on one side only somewhere: a run merged on the device pages alone
    # (3-6, 10-12) or the host pages alone (2-5 across device 6 -> 10, 9-10 across 12 -> 20), descending
    # device pages (15, 14), or page_first_direct's host rows (consecutive pages are not adjacent) would copy
    # some page from or to the wrong place.
    P, L = 2, 3
    dev_pages = torch.tensor([3, 4, 5, 6, 10, 11, 12, 20, 15, 14])
    host_pages = torch.tensor([7, 8, 2, 3, 4, 5, 9, 10, 0, 1])
    dev = DeviceKVPool(21 * P, P, L, heads, head_dim, torch.float16)  # pages 1..21
    host = HostKVPool(24 * P, P, L, heads, head_dim, torch.float16, layout)
    io = DirectIO(dev, host, native=native)
    assert io.native is native
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape))
    dev.kv_buffer.fill_(-7.0)
    to_slots = lambda pages: (pages[:, None] * P + torch.arange(P)).flatten()  # noqa: E731
    dev_slots, host_slots = to_slots(dev_pages), to_slots(host_pages)
    plan = io.plan(dev_slots, host_slots)
    for layer in range(L):
        io.load_layer(layer, plan)
    for layer in range(L):
        for kv, buffer in enumerate((dev.k_buffer[layer], dev.v_buffer[layer])):
            for d, h in zip(dev_pages.tolist(), host_pages.tolist(), strict=True):
                assert torch.equal(buffer[d * P : (d + 1) * P], _host_page(host, kv, layer, h)), (
                    layer,
                    kv,
                    d,
                )
    untouched = torch.ones(dev.kv_buffer.shape[2] // P, dtype=torch.bool)
    untouched[dev_pages] = False
    assert bool((dev.kv_buffer.unflatten(2, (-1, P))[:, :, untouched] == -7.0).all())

    # and back: device pages to other host pages, the rest of the host pool unchanged
    before = host.kv_buffer.clone()
    back = torch.tensor([12, 13, 16, 17, 18, 19, 20, 21, 23, 22])
    io.backup(dev_slots, to_slots(back))
    for layer in range(L):
        for kv in range(2):
            for d, h in zip(dev_pages.tolist(), back.tolist(), strict=True):
                expect = _host_page(host, kv, layer, h)
                assert torch.equal(expect, dev.kv_buffer[kv, layer, d * P : (d + 1) * P]), (layer, kv, h)
    for h in set(range(24)) - set(back.tolist()):
        for layer in range(L):
            for kv in range(2):
                assert torch.equal(_host_page(host, kv, layer, h), _host_page(host, kv, layer, h, before))


def test_copy_pages_refuses_bad_pages_and_copies_nothing():
    dev = DeviceKVPool(8, 2, 1, 1, 4, torch.float16)
    host = HostKVPool(8, 2, 1, 1, 4, torch.float16)
    io = DirectIO(dev, host)
    assert io.native
    host.kv_buffer.fill_(1.0)
    with pytest.raises(IndexError, match=r"src_pages\[1\] = 4 is out of range for 4 pages"):
        io.load_layer(0, (torch.tensor([1, 2]), torch.tensor([0, 4]), None))
    with pytest.raises(ValueError, match="2 destination pages, 1 source pages"):
        io.load_layer(0, (torch.tensor([1, 2]), torch.tensor([0]), None))
    with pytest.raises(ValueError, match="dst_pages must be a contiguous 1-D int64"):
        io.load_layer(0, (torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1]), None))
    assert bool((dev.kv_buffer == 0).all())
