"""Mooncake backend configuration: sizes, precedence, TP division, errors naming the key, start-up checks."""

import json

import pytest

from engine.cache.storage.base import StorageConfigError, StorageError
from engine.cache.storage.mooncake import MooncakeStore
from engine.cache.storage.mooncake_config import MooncakeConfig, parse_size
from engine.ports import free_port

MOONCAKE_ENV = (
    "MOONCAKE_MASTER",
    "MOONCAKE_PROTOCOL",
    "MOONCAKE_DEVICE",
    "MOONCAKE_TE_META_DATA_SERVER",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "MOONCAKE_LOCAL_BUFFER_SIZE",
    "LOCAL_HOSTNAME",
    "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in MOONCAKE_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    "text, expected",
    [("4gb", 4 << 30), ("4GB", 4 << 30), ("512mb", 512 << 20), ("1.5gb", 3 << 29), ("64 MiB", 64 << 20),
     ("1024", 1024), (2048, 2048), ("16k", 16 << 10)],
)  # fmt: skip
def test_parse_size(text, expected):
    assert parse_size("global_segment_size", text) == expected


@pytest.mark.parametrize("bad", ["4gx", "lots", "", "-1gb", 0, -5, True, 1.5, None])
def test_bad_size_names_the_key(bad):
    with pytest.raises(StorageConfigError, match="^local_buffer_size: "):
        parse_size("local_buffer_size", bad)


def test_a_size_that_rounds_to_zero_bytes_is_named_as_given():
    with pytest.raises(StorageConfigError, match=r"got '0\.0001kb' \(0 bytes\)$"):
        parse_size("global_segment_size", "0.0001kb")


def resolve(storage_config_factory, extra=None, **kw):
    return MooncakeConfig.from_storage_config(storage_config_factory(extra=extra, **kw))


def test_extra_config_seed_example_divided_across_tp_ranks(storage_config_factory):
    extra = {
        "master_server_address": "127.0.0.1:50051",
        "metadata_server": "http://127.0.0.1:8080/metadata",
        "protocol": "tcp",
        "device_name": "",
        "global_segment_size": "4gb",
        "local_buffer_size": 32 << 20,
        "extra_backend_tag": "fleet",
    }
    cfg = resolve(storage_config_factory, extra, tp_rank=1, tp_size=2)
    assert cfg.global_segment_size == 2 << 30 and cfg.local_buffer_size == 16 << 20
    assert (cfg.master_server_address, cfg.metadata_server) == (
        extra["master_server_address"],
        extra["metadata_server"],
    )
    assert (cfg.protocol, cfg.extra_backend_tag, cfg.source) == ("tcp", "fleet", "extra_config")
    assert cfg.master_host_port == ("127.0.0.1", 50051)


def test_defaults(storage_config_factory):
    cfg = resolve(storage_config_factory, {"master_server_address": "10.0.0.1:50051"})
    assert (cfg.metadata_server, cfg.protocol, cfg.global_segment_size) == ("P2PHANDSHAKE", "tcp", 4 << 30)


def test_environment_when_extra_config_has_no_master(storage_config_factory, monkeypatch):
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:6000")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.setenv("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1gb")
    cfg = resolve(storage_config_factory, {}, tp_size=4)
    assert (cfg.master_server_address, cfg.global_segment_size, cfg.source) == (
        "127.0.0.1:6000",
        1 << 28,
        "environment",
    )


def test_config_file_from_env(storage_config_factory, monkeypatch, tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:7000", "global_segment_size": "2gb"}))
    monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
    cfg = resolve(storage_config_factory, {})
    assert (cfg.master_server_address, cfg.global_segment_size) == ("127.0.0.1:7000", 2 << 30)


def test_missing_master_names_the_key(storage_config_factory):
    with pytest.raises(StorageConfigError, match="^master_server_address: .*MOONCAKE_MASTER"):
        resolve(storage_config_factory, {})
    # a Mooncake key with no master in the extra config would be ignored (the environment is read): refused
    with pytest.raises(StorageConfigError, match="^protocol: read only when this extra config names master"):
        resolve(storage_config_factory, {"protocol": "tcp"})


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"master_server_address": "127.0.0.1:1", "global_segmnt_size": "4gb"}, "global_segmnt_size"),
        ({"master_server_address": "127.0.0.1:1", "protocol": 5}, "protocol"),
        ({"master_server_address": "127.0.0.1:1", "protocol": "carrier-pigeon"}, "protocol"),
        ({"master_server_address": "127.0.0.1:1", "global_segment_size": "4 gigs"}, "global_segment_size"),
        ({"master_server_address": "127.0.0.1:1", "local_buffer_size": [1]}, "local_buffer_size"),
        ({"master_server_address": "127.0.0.1:1", "metadata_server": "somewhere"}, "metadata_server"),
        ({"master_server_address": "no-port"}, "master_server_address"),
        ({"master_server_address": "127.0.0.1:99999"}, "master_server_address"),
    ],
)
def test_bad_extra_config_names_the_key(storage_config_factory, extra, key):
    with pytest.raises(StorageConfigError, match=f"^{key}: "):
        resolve(storage_config_factory, extra)


def test_layer_first_layout_is_refused(storage_config_factory):
    cfg = storage_config_factory(layout="layer_first", extra={"master_server_address": "127.0.0.1:1"})
    with pytest.raises(
        StorageConfigError, match="^layout: .*page_first or page_first_direct, got 'layer_first'"
    ):
        MooncakeStore(cfg)


def test_unreachable_master_fails_at_start_naming_the_address(storage_config_factory):
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(StorageError, match=f"Mooncake master {address} is unreachable"):
        MooncakeStore(storage_config_factory(extra={"master_server_address": address}))


def test_backoff_pauses_then_resumes_only_after_a_successful_probe(monkeypatch):
    from engine.cache.storage import mooncake

    clock = [100.0]
    monkeypatch.setattr(mooncake.time, "monotonic", lambda: clock[0])
    master_up = [False]
    backoff = mooncake._Backoff(lambda: master_up[0], first_s=1.0, max_s=4.0)
    assert backoff.allow() and not backoff.paused
    backoff.failed()
    assert backoff.paused and not backoff.allow(), "inside the window: refused without probing"
    clock[0] += 1.5
    assert not backoff.allow(), "window over, probe fails: the window doubles to 2 s"
    clock[0] += 1.5
    assert not backoff.allow(), "still inside the doubled window"
    clock[0] += 1.0
    master_up[0] = True
    assert backoff.allow(), "probe succeeds: calls go through again"
    backoff.succeeded()
    assert not backoff.paused
    for _ in range(5):
        backoff.failed()
    clock[0] += 4.1
    assert backoff.allow(), "the window never exceeds max_s"
