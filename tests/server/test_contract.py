"""The worker contract's reading of a ``/server_info`` body into HiCache settings
(``reported_hicache_config``), on the shapes upstream SGLang answers: its launch args, and the HiCache keys
of the extra config it was given; what it does not report is named, with why, never filled in. (KVFleet's
own shape is checked against a real engine in test_server_admin.py.)"""

from engine.server.contract import HICACHE_STATUS_FIELDS, reported_hicache_config

UPSTREAM = {  # the HiCache part of an upstream SGLang 0.5.23 /server_info (its ServerArgs, as dest names)
    "version": "0.5.23",
    "enable_hierarchical_cache": True,
    "hicache_ratio": 2.0,
    "hicache_write_policy": "write_through",
    "hicache_io_backend": "direct",
    "hicache_mem_layout": "layer_first",
    "hicache_storage_backend": "file",
    "hicache_storage_prefetch_policy": "timeout",
    "radix_eviction_policy": "lru",
}


def test_upstream_reports_its_launch_args_and_its_extra_configs_hicache_keys():
    extra = '{"file_storage_path": "/l3", "prefetch_threshold": 32, "prefetch_timeout_base": 0.5}'
    config, unreported = reported_hicache_config({**UPSTREAM, "hicache_storage_backend_extra_config": extra})
    assert config == {
        "hicache_storage_backend": "file",
        "hicache_storage_prefetch_policy": "timeout",
        "hicache_write_policy": "write_through",
        "hicache_mem_layout": "layer_first",
        "hicache_io_backend": "direct",
        "radix_eviction_policy": "lru",
        "hicache_storage_backend_extra_config": {"file_storage_path": "/l3"},  # the backend's part
        "prefetch_threshold": 32,
        "prefetch_timeout_base": 0.5,
    }
    assert set(config) | set(unreported) == set(HICACHE_STATUS_FIELDS)  # every field: a value or a why
    assert unreported["prefetch_timeout_per_ki_token"].startswith(
        "not reported: SGLang 0.5.23 reports only the extra config it was given, which does not set it"
    )
    assert unreported["l2_admission"] == "no such setting on SGLang 0.5.23 (KVFleet's)"


def test_upstream_without_the_keys_says_so_instead_of_a_default():
    config, unreported = reported_hicache_config({**UPSTREAM, "hicache_storage_backend_extra_config": None})
    assert "prefetch_threshold" not in config and config["hicache_storage_backend_extra_config"] is None
    assert "does not set it (the engine runs its built-in default)" in unreported["prefetch_threshold"]
    from_file = {**UPSTREAM, "hicache_storage_backend_extra_config": "@/etc/l3.toml"}
    assert reported_hicache_config(from_file)[1]["prefetch_threshold"] == (
        "not reported: its extra config is a file (/etc/l3.toml) SGLang 0.5.23 read at start"
    )
    broken = {**UPSTREAM, "hicache_storage_backend_extra_config": "[1, 2]"}
    assert "not a JSON object ('[1, 2]')" in reported_hicache_config(broken)[1]["prefetch_threshold"]
    older = {k: v for k, v in UPSTREAM.items() if k != "radix_eviction_policy"}  # a release without the flag
    assert reported_hicache_config(older)[1]["radix_eviction_policy"] == (
        "SGLang 0.5.23's /server_info has no radix_eviction_policy"
    )


def test_without_a_hierarchical_cache_nothing_is_reported_or_missing():
    assert reported_hicache_config({**UPSTREAM, "enable_hierarchical_cache": False}) == ({}, {})
    assert reported_hicache_config({"hicache": None, "enable_hierarchical_cache": False}) == ({}, {})


def test_upstreams_live_storage_view_wins_over_its_startup_configuration():
    """Upstream's /server_info keeps the launch values after a runtime attach; its GET
    /hicache/storage-backend has the live ones (with the new extra config's HiCache keys)."""
    live = {
        "hicache_storage_backend": "mooncake",
        "hicache_storage_backend_extra_config": '{"master_server_address": "m", "prefetch_threshold": 64}',
        "hicache_storage_prefetch_policy": "best_effort",
        "hicache_write_policy": "write_back",
    }
    launched = {**UPSTREAM, "hicache_storage_backend_extra_config": '{"prefetch_threshold": 32}'}
    config, unreported = reported_hicache_config(launched, storage=live)
    assert config["hicache_storage_backend"] == "mooncake" and config["hicache_write_policy"] == "write_back"
    assert config["prefetch_threshold"] == 64
    assert config["hicache_storage_backend_extra_config"] == {"master_server_address": "m"}
    assert config["hicache_mem_layout"] == "layer_first"  # not in the live view: the launch arg
    assert "prefetch_threshold" not in unreported
