"""The keys an L3 backend's extra config (``--hicache-storage-backend-extra-config``) may hold, checked where
the flags are parsed, before the model loads, and again where the backend is built (the admin attach too):
one check, so both name a bad key alike. Imports neither torch nor the backend's package.

A backend declares its keys here by an entry of ``_CHECKS``; the check sees only what the backend itself
gets (HiCache's own keys, ``prefetch_threshold`` and the rest, are taken out first: ``backend_extra``) and
only what does not depend on the environment (the worker's environment may differ from the parser's, e.g.
when an agent checks a spec). Today ``aibrix`` and ``lmcache`` declare their keys; the other backends check
theirs when they are built (``mooncake``: only an extra config that names a master is read at all, so its
keys are checked then).

Errors are ``ValueError``s starting with the key (``rocksdb_rot: not an AIBrix KVCache setting ...; did you
mean 'rocksdb_root'?``); the parser puts the flag in front.
"""

from __future__ import annotations

import difflib
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

from engine.cache.config import backend_extra

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
    """Refuse a key that is not one of ``LMCACHE_KEYS`` (ValueError naming it and the nearest)."""
    for key in extra:
        if key not in LMCACHE_KEYS:
            raise ValueError(
                f"{key}: not an lmcache backend key (known: {', '.join(LMCACHE_KEYS)})"
                f"{closest_key(key, LMCACHE_KEYS)}"
            )


_CHECKS: dict[str, Callable[[dict], None]] = {"aibrix": _check_aibrix, "lmcache": check_lmcache_keys}


def check_extra_keys(backend: str | None, extra: dict) -> None:
    """Refuse a key of ``extra`` (a parsed extra config, HiCache's keys included) that ``backend`` does not
    take (``ValueError`` naming it); a backend without an entry here (or None) checks its own when built."""
    check = _CHECKS.get(backend or "")
    if check is not None:
        check(backend_extra(extra))
