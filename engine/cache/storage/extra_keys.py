"""The keys an L3 backend's extra config (``--hicache-storage-backend-extra-config``) may hold, and their
values, checked where the flags are parsed, before the model loads, where the control plane saves a storage
profile, and again where the backend is built (the admin attach too): one check, so all name a bad key or
value alike. Imports neither torch nor the backend's package.

:func:`check_extra_keys` checks HiCache's own keys' values (``prefetch_threshold`` an int >= 0, the
timeouts numbers >= 0, ...: ``split_extra_config``) for every backend, then hands what the backend itself
gets (``backend_extra``) to the backend's entry of ``_CHECKS``, which checks only what does not depend on
the environment (the worker's environment may differ from the parser's, e.g. when an agent checks a spec):

- ``aibrix``: its keys (AIBrix's settings);
- ``lmcache``: its keys, ``lmcache_url`` ``lm://host:port`` (or ``host:port``), ``lmcache_timeout_s`` a
  number of seconds > 0 (a URL left out may come from ``LMCACHE_REMOTE_URL``);
- ``mooncake``: only an extra config that names a master is read at all (Mooncake keys without one are
  refused, as they would be ignored); then its keys, strings,
  ``master_server_address`` ``host:port``, ``protocol`` tcp | rdma, ``metadata_server``, and sizes (bytes
  or ``"4gb"``, > 0);
- ``file``: only ``file_path`` (or ``file_storage_path``), when given a non-empty string (another key would be
  ignored: refused); ``nixl``: ``file_path``, when given, a non-empty string;
- ``dynamic``: ``backend_name``, ``module_path`` and ``class_name`` non-empty strings.

Errors are ``ValueError``s starting with the key and saying what is expected (``rocksdb_rot: not an AIBrix
KVCache setting ...; did you mean 'rocksdb_root'?``, ``lmcache_timeout_s: must be a number of seconds > 0,
got 'soon'``); the parser puts the flag in front, the control plane the field (``extra_config``).
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import sys
from collections.abc import Callable
from types import ModuleType

from engine.cache.config import HiCacheConfig, backend_extra, split_extra_config

AIBRIX_ENV_PREFIX = "AIBRIX_KV_CACHE_OL_"
LMCACHE_KEYS = ("lmcache_url", "lmcache_timeout_s")
"""The ``lmcache`` backend's keys: its server (``lm://host:port``) and seconds per socket operation."""
AIBRIX_IMPORT_TIME = ("TOKEN_VALIDATION_ENABLED", "PROFILING_ENABLED", "PROFILING_SERVER_ADDRESS")
"""Settings AIBrix reads once, when ``aibrix_kvcache`` is imported: environment only."""


def closest_key(key: str, known) -> str:
    """ "; did you mean 'x'?" for the known key nearest ``key`` (difflib, cutoff 0.6), else ""."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _aibrix_envs() -> ModuleType | None:
    """AIBrix's settings module (``aibrix_kvcache.envs``, which imports only ``os``): the imported one, else
    loaded from its file without importing the package (torch, its cache manager); None when aibrix-kvcache
    is not installed."""
    if "aibrix_kvcache.envs" in sys.modules:
        return sys.modules["aibrix_kvcache.envs"]
    package = importlib.util.find_spec("aibrix_kvcache")
    if package is None or not package.submodule_search_locations:
        return None
    spec = importlib.util.spec_from_file_location(
        "_kvfleet_aibrix_envs", f"{package.submodule_search_locations[0]}/envs.py"
    )
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def aibrix_setting_names() -> list[str] | None:
    """Every ``AIBRIX_KV_CACHE_OL_*`` name AIBrix reads, less the prefix, sorted; None when aibrix-kvcache is
    not installed (building the backend says so, naming its requirements file)."""
    envs = _aibrix_envs()
    if envs is None:
        return None
    return sorted(n[len(AIBRIX_ENV_PREFIX) :] for n in dir(envs) if n.startswith(AIBRIX_ENV_PREFIX))


def aibrix_setting(key: str, names: list[str]) -> str:
    """The AIBrix setting (name without prefix) extra-config ``key`` sets: ``AIBRIX_KV_CACHE_OL_<NAME>`` or
    ``<name>`` in lower case. Raises ValueError naming ``key`` (and the nearest real key, in the form given)
    when it is no setting of ``names``, or one AIBrix reads only at import."""
    prefixed = key.startswith(AIBRIX_ENV_PREFIX)
    name = key[len(AIBRIX_ENV_PREFIX) :] if prefixed else key.upper()
    if name not in names or (not prefixed and key != key.lower()):
        forms = [AIBRIX_ENV_PREFIX + n for n in names] if prefixed else [n.lower() for n in names]
        hint = closest_key(key if prefixed else key.lower(), forms)
        raise ValueError(
            f"{key}: not an AIBrix KVCache setting (give {AIBRIX_ENV_PREFIX}<NAME> or <name> in lower "
            f"case; e.g. l2_cache_backend, rocksdb_root){hint}"
        )
    if name in AIBRIX_IMPORT_TIME:
        raise ValueError(
            f"{key}: AIBrix reads {AIBRIX_ENV_PREFIX}{name} once, at import; set it in the environment"
        )
    return name


def _check_aibrix(extra: dict) -> None:
    names = aibrix_setting_names()
    if names is None:
        return
    for key in extra:
        aibrix_setting(key, names)


def check_lmcache_keys(extra: dict) -> None:
    """Refuse a key that is not one of ``LMCACHE_KEYS`` (ValueError naming it and the nearest), a
    ``lmcache_url`` that is not ``lm://host:port`` and a ``lmcache_timeout_s`` that is not a number > 0."""
    for key in extra:
        if key not in LMCACHE_KEYS:
            raise ValueError(
                f"{key}: not an lmcache backend key (known: {', '.join(LMCACHE_KEYS)})"
                f"{closest_key(key, LMCACHE_KEYS)}"
            )
    if "lmcache_url" in extra:
        lmcache_host_port(extra["lmcache_url"])
    if "lmcache_timeout_s" in extra:
        lmcache_timeout(extra["lmcache_timeout_s"])


def lmcache_host_port(value: object, key: str = "lmcache_url") -> tuple[str, int]:
    """(host, port) of ``lm://host:port`` or ``host:port``; ValueError naming ``key`` otherwise."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key}: must be lm://host:port, got {value!r}")
    text = value.strip()
    if "://" in text:
        scheme, _, text = text.partition("://")
        if scheme != "lm":
            raise ValueError(
                f"{key}: {value!r}: only lm:// (an lmcache_server) is served here, not {scheme}://"
            )
    host, sep, port = text.rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{key}: {value!r} is not lm://host:port (a port in 1..65535)")
    return host.strip("[]"), int(port)


def lmcache_timeout(value: object) -> float:
    """``lmcache_timeout_s`` as seconds; ValueError naming it unless a number > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"lmcache_timeout_s: must be a number of seconds > 0, got {value!r}")
    return float(value)


MOONCAKE_STRING_KEYS = (
    "master_server_address",
    "local_hostname",
    "metadata_server",
    "protocol",
    "device_name",
)
MOONCAKE_SIZE_KEYS = ("global_segment_size", "local_buffer_size")
MOONCAKE_KEYS = frozenset(
    (*MOONCAKE_STRING_KEYS, *MOONCAKE_SIZE_KEYS, "extra_backend_tag", "master_metrics_port", "check_server")
)
"""Every key of a Mooncake config (upstream's ``master_metrics_port`` and ``check_server``: accepted,
unused)."""
MOONCAKE_P2P_HANDSHAKE = "P2PHANDSHAKE"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)


def parse_size(key: str, value: object) -> int:
    """Bytes from an int or a size string (``"4gb"``, ``"512 MiB"``, ``"1024"``; 1024-based); positive only.
    ValueError naming ``key`` and the forms expected."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{key}: expected an integer or a size string like '4gb', got {value!r}")
    given = value
    if isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        if match is None:
            raise ValueError(f"{key}: cannot parse size {value!r} (use bytes or e.g. '4gb', '512mb')")
        value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:  # a string such as "0.0001kb" rounds to 0 bytes: say what was given
        shown = repr(given) if given == value else f"{given!r} ({value} bytes)"
        raise ValueError(f"{key}: size must be positive, got {shown}")
    return value


def split_address(key: str, address: object) -> tuple[str, int]:
    """(host, port) of ``host:port``; ValueError naming ``key`` otherwise."""
    if not isinstance(address, str):
        raise ValueError(f"{key}: expected 'host:port', got {address!r}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{key}: expected 'host:port' (a port in 1..65535), got {address!r}")
    return host, int(port)


def mooncake_fields(raw: dict, source: str) -> dict:
    """The checked settings of a Mooncake config ``raw`` (read from ``source``, named in the errors): its
    strings, ``master_server_address`` (required), and the sizes in bytes (not yet divided by tp size).
    ValueError naming the first bad key and what it expects."""
    unknown = sorted(set(raw) - MOONCAKE_KEYS)
    if unknown:
        raise ValueError(
            f"{unknown[0]}: unknown Mooncake config key (from {source}); known: "
            f"{', '.join(sorted(MOONCAKE_KEYS))}"
            f"{closest_key(unknown[0], MOONCAKE_KEYS)}"
        )
    fields: dict = {}
    for key in (*MOONCAKE_STRING_KEYS, "extra_backend_tag"):
        if key in raw:
            if not isinstance(raw[key], str):
                raise ValueError(f"{key}: expected a string, got {type(raw[key]).__name__} {raw[key]!r}")
            fields[key] = raw[key]
    if not fields.get("master_server_address"):
        raise ValueError(f"master_server_address: required (from {source})")
    split_address("master_server_address", fields["master_server_address"])
    if fields.get("protocol", "tcp") not in ("tcp", "rdma"):
        raise ValueError(f"protocol: expected 'tcp' or 'rdma', got {fields['protocol']!r}")
    metadata = fields.get("metadata_server", MOONCAKE_P2P_HANDSHAKE)
    if metadata != MOONCAKE_P2P_HANDSHAKE and not re.match(r"(https?|etcd|redis)://", metadata):
        raise ValueError(
            f"metadata_server: expected {MOONCAKE_P2P_HANDSHAKE} or an http://, etcd:// or redis:// URL, "
            f"got {metadata!r}"
        )
    for key in MOONCAKE_SIZE_KEYS:
        if key in raw:
            fields[key] = parse_size(key, raw[key])
    return fields


def mooncake_keys_need_master(extra: dict) -> None:
    """Refuse Mooncake keys in an extra config that names no master: the config then comes from
    ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` or the ``MOONCAKE_*`` environment, so they would be ignored
    (upstream ignores them silently). ValueError naming the first such key."""
    named = sorted(set(extra) & MOONCAKE_KEYS)
    if named and not extra.get("master_server_address"):
        raise ValueError(
            f"{named[0]}: read only when this extra config names master_server_address; without it the "
            "Mooncake config comes from SGLANG_HICACHE_MOONCAKE_CONFIG_PATH or the MOONCAKE_* environment, "
            "which would ignore it (add master_server_address here, or set it there)"
        )


def _check_mooncake(extra: dict) -> None:
    mooncake_keys_need_master(extra)
    if extra.get("master_server_address"):  # else the config file or the environment is read, not ``extra``
        mooncake_fields(extra, "extra_config")


FILE_KEYS = ("file_path", "file_storage_path")
"""The ``file`` backend's keys: its directory, by KVFleet's name or upstream's."""


def _check_file(extra: dict) -> None:
    """The ``file`` backend takes only its directory: any other key (a misspelt HiCache key such as
    ``prefetch_thresold`` lands here) would be ignored, so it is refused naming the closest real key."""
    unknown = sorted(set(extra) - set(FILE_KEYS))
    if unknown:
        known = (*FILE_KEYS, *(key for key, _ in HICACHE_KEY_HINTS))
        raise ValueError(
            f"{unknown[0]}: not a key of the file backend (it takes {' or '.join(FILE_KEYS)}) nor of "
            f"HiCache{closest_key(unknown[0], known)}"
        )
    _check_file_path(extra)


def _check_file_path(extra: dict) -> None:
    for key in FILE_KEYS:
        if key in extra and (not isinstance(extra[key], str) or not extra[key].strip()):
            raise ValueError(f"{key}: must be a directory path (a non-empty string), got {extra[key]!r}")


def _check_dynamic(extra: dict) -> None:
    for key in ("backend_name", "module_path", "class_name"):
        value = extra.get(key)
        if not value or not isinstance(value, str):
            raise ValueError(
                f"{key}: required for the dynamic storage backend (a non-empty string), got {value!r}"
            )


_CHECKS: dict[str, Callable[[dict], None]] = {
    "aibrix": _check_aibrix,
    "lmcache": check_lmcache_keys,
    "mooncake": _check_mooncake,
    "file": _check_file,
    "nixl": _check_file_path,
    "dynamic": _check_dynamic,
}


HICACHE_KEY_HINTS = (
    ("prefetch_threshold", "int >= 0: fewest L3 tokens worth a prefetch"),
    ("prefetch_timeout_base", "seconds >= 0"),
    ("prefetch_timeout_per_ki_token", "seconds >= 0 per 1024 tokens"),
    ("prefetch_timeout_max", "seconds >= 0"),
    ("hicache_storage_pass_prefix_keys", "true | false"),
    ("breaker_failures", "int >= 1: failed L3 calls in a row that open the breaker"),
    ("breaker_latency_s", "seconds >= 0: a slower L3 call counts as failed"),
    ("breaker_open_s", "seconds >= 0"),
    ("breaker_ramp_s", "seconds >= 0"),
    ("auto_detach_after_s", "seconds >= 0, or null: detach L3 when the breaker stays open this long"),
    ("l2_admission", "none | tinylfu"),
    ("l3_admission", "none | tinylfu"),
    ("tp_lcm_size", "int >= 1: lcm of the TP sizes sharing L3"),
)
"""HiCache's own extra-config keys (any backend), each with what it takes: the storage profile form's hint."""

BACKEND_KEY_HINTS: dict[str, tuple[tuple[str, str], ...]] = {
    "file": (
        ("file_path", "directory (or file_storage_path); else $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"),
    ),
    "nixl": (
        ("file_path", "directory; else $SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"),
        ("plugin", '"POSIX" or "auto", or {"posix": {"active": true, ...}}'),
        ("use_aio, use_uring, use_posix_aio, kernel_queue_size, ios_pool_size", "POSIX plugin parameters"),
    ),
    "mooncake": (
        ("master_server_address", "host:port (without it the config file or environment is read instead)"),
        ("metadata_server", "P2PHANDSHAKE or an http://, etcd:// or redis:// URL"),
        ("protocol", "tcp | rdma"),
        ("global_segment_size, local_buffer_size", 'bytes or a size such as "4gb" (> 0)'),
        ("local_hostname, device_name, extra_backend_tag", "strings"),
    ),
    "lmcache": (
        ("lmcache_url", "lm://host:port (else $LMCACHE_REMOTE_URL)"),
        ("lmcache_timeout_s", "seconds > 0 per socket operation (default 10)"),
    ),
    "aibrix": (
        (
            "<name> or AIBRIX_KV_CACHE_OL_<NAME>",
            "an AIBrix KVCache setting, e.g. l2_cache_backend (ROCKSDB, ...), rocksdb_root",
        ),
    ),
    "dynamic": (
        ("backend_name, module_path, class_name", "required strings: the class to load"),
        ("interface_v1", "true | false"),
        ("any other key", "passed to the class"),
    ),
}
"""Each backend's own extra-config keys and what they take (the checks above; the form's hint)."""


def check_extra_keys(backend: str | None, extra: dict) -> None:
    """Refuse a key or value of ``extra`` (a parsed extra config, HiCache's keys included) that HiCache or
    ``backend`` does not take (``ValueError`` starting with the key, saying what it expects): HiCache's own
    keys for any backend, then the backend's part by its entry of ``_CHECKS``; a backend without one (or
    None) checks the rest when built."""
    split_extra_config(HiCacheConfig(), extra)  # HiCache's keys: types and ranges (admission names too)
    check = _CHECKS.get(backend or "")
    if check is not None:
        check(backend_extra(extra))
