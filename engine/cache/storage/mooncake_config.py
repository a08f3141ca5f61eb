"""Configuration of the ``mooncake`` backend, resolved and validated at start-up.

Follows SGLang's ``MooncakeStoreConfig`` (docs/upstream.md H6) precedence: ``extra_config`` when it has
``master_server_address``; else the JSON file named by ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``; else the
environment (``MOONCAKE_MASTER`` required, ``MOONCAKE_PROTOCOL``, ``MOONCAKE_DEVICE``,
``MOONCAKE_TE_META_DATA_SERVER``, ``MOONCAKE_GLOBAL_SEGMENT_SIZE``, ``MOONCAKE_LOCAL_BUFFER_SIZE``,
``LOCAL_HOSTNAME``). Sizes are byte counts or strings such as ``"4gb"``/``"512MB"`` (1024-based) and are
divided by ``tp_size`` (each rank mounts its share). Upstream's ``master_metrics_port`` and
``check_server`` are accepted so seed configs load, and not used. Any other key, a wrong type or an
unparsable value is a :class:`StorageConfigError` naming the key, as are Mooncake keys in an extra config
that names no master (upstream ignores them; here they would be lost silently).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from engine.cache.storage.base import HiCacheStorageConfig, StorageConfigError
from engine.cache.storage.extra_keys import MOONCAKE_P2P_HANDSHAKE as P2P_HANDSHAKE
from engine.cache.storage.extra_keys import (
    MOONCAKE_STRING_KEYS,
    mooncake_fields,
    mooncake_keys_need_master,
    split_address,
)
from engine.cache.storage.extra_keys import parse_size as _parse_size

CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
DEFAULT_GLOBAL_SEGMENT_SIZE = 4 << 30
DEFAULT_LOCAL_BUFFER_SIZE = 16 << 20
_STRING_KEYS = MOONCAKE_STRING_KEYS
_ENV = {
    "master_server_address": "MOONCAKE_MASTER",
    "local_hostname": "LOCAL_HOSTNAME",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "local_buffer_size": "MOONCAKE_LOCAL_BUFFER_SIZE",
}


def parse_size(key: str, value: int | str) -> int:
    """Bytes from an int or a size string (``"4gb"``, ``"512 MiB"``, ``"1024"``); positive only
    (the check the flag parser runs, ``extra_keys.parse_size``, as a :class:`StorageConfigError`)."""
    try:
        return _parse_size(key, value)
    except ValueError as exc:
        raise StorageConfigError(str(exc)) from None


def _split_address(key: str, address: str) -> tuple[str, int]:
    try:
        return split_address(key, address)
    except ValueError as exc:
        raise StorageConfigError(str(exc)) from None


@dataclass(frozen=True)
class MooncakeConfig:
    """Resolved per-rank settings for ``MooncakeDistributedStore.setup``."""

    master_server_address: str
    metadata_server: str = P2P_HANDSHAKE
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    extra_backend_tag: str = ""
    source: str = "extra_config"

    @property
    def master_host_port(self) -> tuple[str, int]:
        return _split_address("master_server_address", self.master_server_address)

    @classmethod
    def from_storage_config(cls, storage_config: HiCacheStorageConfig) -> MooncakeConfig:
        """Resolve extra_config / config file / environment, validate, and divide sizes by tp_size."""
        return cls.resolve(storage_config.extra_config, storage_config.tp_size)

    @classmethod
    def resolve(cls, extra: dict, tp_size: int = 1) -> MooncakeConfig:
        """``extra`` when it names a master, else the config file, else the environment (the order above);
        raises :class:`StorageConfigError` naming the key."""
        try:
            mooncake_keys_need_master(extra)
        except ValueError as exc:
            raise StorageConfigError(str(exc)) from None
        if extra.get("master_server_address"):
            raw, source = dict(extra), "extra_config"
        elif os.environ.get(CONFIG_PATH_ENV):
            raw, source = _load_file(os.environ[CONFIG_PATH_ENV]), CONFIG_PATH_ENV
        else:
            raw = {key: os.environ[env] for key, env in _ENV.items() if os.environ.get(env)}
            source = "environment"
            if "master_server_address" not in raw:
                raise StorageConfigError(
                    "master_server_address: no Mooncake master configured; set extra_config "
                    "master_server_address, SGLANG_HICACHE_MOONCAKE_CONFIG_PATH or MOONCAKE_MASTER"
                )
        return cls._validated(raw, source, tp_size)

    @classmethod
    def _validated(cls, raw: dict, source: str, tp_size: int) -> MooncakeConfig:
        try:  # the check the flag parser runs on an extra config that names a master (extra_keys.py)
            fields = mooncake_fields(raw, source)
        except ValueError as exc:
            raise StorageConfigError(str(exc)) from None
        for key, default in (
            ("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE),
            ("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE),
        ):
            fields[key] = max(1, fields.get(key, default) // tp_size)
        return cls(**fields, source=source)


def _load_file(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise StorageConfigError(f"{CONFIG_PATH_ENV}: cannot read Mooncake config {path!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise StorageConfigError(f"{CONFIG_PATH_ENV}: {path!r} must hold a JSON object")
    return data
