"""HiCache configuration: upstream defaults, validation and extra-config parsing (docs/upstream.md H8).

``HiCacheConfig`` mirrors SGLang's ``--hicache-*`` / ``--radix-eviction-policy`` flags. The extra config
(``--hicache-storage-backend-extra-config``) is a JSON object string or ``@path`` to a ``.json``,
``.toml``, ``.yaml`` or ``.yml`` file; the HiCache keys in it (prefetch threshold and timeouts,
``hicache_storage_pass_prefix_keys``, ``tp_lcm_size``) are popped and type-checked by
:func:`split_extra_config`, the rest goes to the storage backend. Every error is a ``ValueError`` naming
the field, key or file.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from engine.cache.eviction_names import EVICTION_POLICIES

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
IO_BACKENDS = ("direct", "kernel")
MEM_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
ADMISSIONS = ("none", "tinylfu")  # engine/cache/admission.py
_CHOICES = {
    "write_policy": WRITE_POLICIES,
    "prefetch_policy": PREFETCH_POLICIES,
    "io_backend": IO_BACKENDS,
    "mem_layout": MEM_LAYOUTS,
    "eviction_policy": EVICTION_POLICIES,
    "l2_admission": ADMISSIONS,
    "l3_admission": ADMISSIONS,
}
# Extra-config keys HiCache consumes (popped before the dict reaches the backend) and their types.
_EXTRA_NUMBERS: tuple[str, ...]
_EXTRA_NUMBERS = ("prefetch_timeout_base", "prefetch_timeout_per_ki_token", "prefetch_timeout_max")
_EXTRA_NUMBERS += ("breaker_latency_s", "breaker_open_s", "breaker_ramp_s")  # L3 breaker (storage/health.py)
_EXTRA_KEYS: tuple[str, ...]
_EXTRA_KEYS = ("prefetch_threshold", "breaker_failures", *_EXTRA_NUMBERS, "hicache_storage_pass_prefix_keys")
_EXTRA_KEYS += ("l2_admission", "l3_admission")  # TinyLFU admission per lower tier
_EXTRA_KEYS += ("auto_detach_after_s",)  # breaker not closed this long: detach L3 (storage/autodetach.py)
_EXTRA_KEYS += ("tp_lcm_size",)  # L3 pages in KV-head shards shared across TP sizes (storage/shards.py)


@dataclass
class HiCacheConfig:
    """HiCache settings with SGLang's defaults.

    ``ratio``: host pool tokens / device pool tokens (must be > 1; used when ``size`` is 0).
    ``size``: host pool GB per rank (overrides ``ratio`` when > 0). Timeouts in seconds, threshold in
    tokens. ``extra_config`` is the backend's part of the extra config (HiCache keys already popped).
    """

    ratio: float = 2.0
    size: float = 0
    write_policy: str = "write_through"
    io_backend: str = "direct"
    mem_layout: str = "layer_first"
    storage_backend: str | None = None
    prefetch_policy: str = "best_effort"
    extra_config: dict = field(default_factory=dict)
    prefetch_threshold: int = 256
    prefetch_timeout_base: float = 2.0
    prefetch_timeout_per_ki_token: float = 0.1
    prefetch_timeout_max: float = 30.0
    breaker_failures: int = 3  # failed L3 calls in a row that open the breaker
    breaker_latency_s: float = 1.0  # an L3 call slower than this counts as failed
    breaker_open_s: float = 1.0  # first open window (doubles per failed probe, up to 30 s)
    breaker_ramp_s: float = 10.0  # after a recovery, backups ramp from 10% to all over this many seconds
    auto_detach_after_s: float | None = None  # breaker not closed this long: detach L3; None: never
    eviction_policy: str = "lru"
    pass_prefix_keys: bool = False
    l2_admission: str = "none"  # none | tinylfu: who gets an L2 copy when L2 is full
    l3_admission: str = "none"  # none | tinylfu: who gets an L3 backup, which L3 pages are prefetched
    tp_lcm_size: int | None = None  # lcm of the TP sizes sharing the L3 namespace; None: keys per rank shard

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field with a bad type or value."""
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")
        _check_int("prefetch_threshold", self.prefetch_threshold, minimum=0)
        _check_int("breaker_failures", self.breaker_failures, minimum=1)
        if self.tp_lcm_size is not None:
            _check_int("tp_lcm_size", self.tp_lcm_size, minimum=1)
        for name in ("ratio", "size", *_EXTRA_NUMBERS):
            _check_number(name, getattr(self, name))
        if self.auto_detach_after_s is not None:
            _check_number("auto_detach_after_s", self.auto_detach_after_s)
        if self.size == 0 and self.ratio <= 1:
            raise ValueError(
                f"ratio: hicache_ratio must be > 1 (host pool larger than device), got {self.ratio}"
            )
        if self.size < 0:
            raise ValueError(f"size: hicache_size must be >= 0 GB, got {self.size}")
        if not isinstance(self.extra_config, dict):
            raise ValueError(f"extra_config: must be a dict, got {type(self.extra_config).__name__}")
        if not isinstance(self.pass_prefix_keys, bool):
            raise ValueError(f"pass_prefix_keys: must be a bool, got {self.pass_prefix_keys!r}")

    def updated(self, **changes: Any) -> HiCacheConfig:
        """A validated copy with ``changes`` applied; unknown field names raise ``ValueError``."""
        known = {f.name for f in fields(self)}
        for name in changes:
            if name not in known:
                raise ValueError(f"{name}: not a HiCache config field")
        return replace(self, **changes)


def _check_int(name: str, value: Any, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: must be a number, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")


def parse_extra_config(text_or_at_file: str | None) -> dict:
    """Parse a JSON object string, or ``@path`` to a ``.json``/``.toml``/``.yaml``/``.yml`` file.

    Empty or None gives ``{}``. Raises ``ValueError`` naming the file for an unsupported extension
    ("Unsupported config file"), a missing/unreadable file or a parse error, and when the top level is
    not an object.
    """
    if not text_or_at_file:
        return {}
    text = text_or_at_file.strip()
    if text.startswith("@"):
        path = Path(text[1:])
        suffix = path.suffix.lower()
        if suffix not in (".json", ".toml", ".yaml", ".yml"):
            raise ValueError(f"Unsupported config file {str(path)!r}: use .json, .toml, .yaml or .yml")
        try:
            raw = path.read_bytes()
            if suffix == ".json":
                data = json.loads(raw)
            elif suffix == ".toml":
                data = tomllib.loads(raw.decode("utf-8"))
            else:
                data = yaml.safe_load(raw)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise ValueError(f"cannot read extra config file {str(path)!r}: {exc}") from exc
        source = f"extra config file {str(path)!r}"
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"hicache_storage_backend_extra_config: invalid JSON: {exc}") from exc
        source = "hicache_storage_backend_extra_config"
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: must be an object/table, got {type(data).__name__}")
    return data


def backend_extra(extra: dict) -> dict:
    """What of ``extra`` reaches the storage backend (what :func:`split_extra_config` leaves), HiCache's keys
    taken out unchecked."""
    return {k: v for k, v in extra.items() if k not in _EXTRA_KEYS}


def split_extra_config(config: HiCacheConfig, extra: dict) -> tuple[HiCacheConfig, dict]:
    """Pop the HiCache keys out of ``extra``: returns (config with them applied, backend's remaining dict).

    ``prefetch_threshold`` must be an int (a string such as ``"256"`` is rejected, as upstream),
    timeouts numbers, ``hicache_storage_pass_prefix_keys`` a bool. ``extra`` itself is not modified.
    """
    remaining = dict(extra)
    changes: dict[str, Any] = {}
    for key in _EXTRA_KEYS:
        if key not in remaining:
            continue
        value = remaining.pop(key)
        if key in ("prefetch_threshold", "breaker_failures", "tp_lcm_size"):
            _check_int(key, value, minimum=0 if key == "prefetch_threshold" else 1)
            changes[key] = value
        elif key in ("l2_admission", "l3_admission"):
            changes[key] = value  # checked against ADMISSIONS by validate()
        elif key == "auto_detach_after_s" and value is None:
            changes[key] = None  # null turns it off (a key left out keeps the value in force)
        elif key == "hicache_storage_pass_prefix_keys":
            if not isinstance(value, bool):
                raise ValueError(f"{key}: must be a bool, got {type(value).__name__} {value!r}")
            changes["pass_prefix_keys"] = value
        else:
            _check_number(key, value)
            changes[key] = value
    return config.updated(**changes, extra_config=remaining), remaining
