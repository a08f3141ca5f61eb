"""Backend registry and factory (SGLang ``storage/backend_factory.py``, docs/upstream.md H6).

Names map to ``(module_path, class_name)`` and are imported lazily, so a backend's dependencies (e.g.
Mooncake) load only when it is used. ``dynamic`` loads a user class named in ``extra_config``
(:mod:`engine.cache.storage.dynamic`). Every backend is built as ``cls(storage_config)`` and then given
the host pool with ``register_mem_pool_host``.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the backends load torch: imported when one is built, so listing names stays cheap
    from engine.cache.storage.base import HiCacheStorage, HiCacheStorageConfig

logger = logging.getLogger(__name__)

DYNAMIC_BACKEND = "dynamic"
"""The name that loads a user's class named in the extra config (:mod:`engine.cache.storage.dynamic`)."""

_BACKENDS: dict[str, tuple[str, str]] = {
    "aibrix": ("engine.cache.storage.aibrix", "HiCacheAibrix"),
    "file": ("engine.cache.storage.file", "HiCacheFile"),
    "lmcache": ("engine.cache.storage.lmcache", "HiCacheLMCache"),
    "mooncake": ("engine.cache.storage.mooncake", "MooncakeStore"),
    "nixl": ("engine.cache.storage.nixl", "HiCacheNixl"),
}


UNAVAILABLE: dict[str, str] = {
    "hf3fs": (
        "DeepSeek 3FS needs its usrbio client (hf3fs-py-usrbio), whose package builds only inside the 3FS "
        "source tree and reads and writes through a mounted 3FS (FUSE); KVFleet cannot install or test it"
    ),
}
"""Upstream's backend names KVFleet does not build: name -> why, said wherever a backend is named."""


def check_backend_name(name: str) -> str:
    """``name`` when it is a registered or the dynamic backend; raises ``ValueError`` saying why an
    upstream backend KVFleet lacks is not available, else listing the registered names."""
    if name in UNAVAILABLE:
        raise ValueError(f"storage backend {name!r} is not available: {UNAVAILABLE[name]}")
    if name != DYNAMIC_BACKEND and name not in _BACKENDS:
        raise ValueError(
            f"unknown storage backend {name!r}; registered backends: {', '.join(registered_backends())}"
        )
    return name


def register_backend(name: str, module_path: str, class_name: str) -> None:
    """Register (or, with a warning, replace) backend ``name`` as ``module_path.class_name``."""
    if name == DYNAMIC_BACKEND:
        raise ValueError(f"{DYNAMIC_BACKEND!r} is reserved for the dynamic loader")
    if name in _BACKENDS:
        logger.warning("storage backend %r re-registered as %s.%s", name, module_path, class_name)
    _BACKENDS[name] = (module_path, class_name)


def registered_backends() -> list[str]:
    """All names ``create_storage_backend`` accepts, sorted."""
    return sorted([*_BACKENDS, DYNAMIC_BACKEND])


def load_backend_class(module_path: str, class_name: str) -> type[HiCacheStorage]:
    """Import ``module_path.class_name`` and check it subclasses :class:`HiCacheStorage`.

    Raises ``ImportError`` (module cannot be imported or has no such class) or ``TypeError`` (not a
    HiCacheStorage subclass), each naming the module and class.
    """
    from engine.cache.storage.base import HiCacheStorage

    try:
        module = importlib.import_module(module_path)
    except Exception as exc:
        raise ImportError(f"cannot import storage backend module {module_path!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ImportError(f"storage backend module {module_path!r} has no class {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, HiCacheStorage)):
        raise TypeError(f"{module_path}.{class_name} is not a subclass of HiCacheStorage")
    return cls


def create_storage_backend(name: str, config: HiCacheStorageConfig, host_pool) -> HiCacheStorage:
    """Build backend ``name`` for ``config`` and register ``host_pool`` (may be None) with it.

    Raises ``ValueError`` for an unknown ``name`` (:func:`check_backend_name`); construction errors (e.g.
    :class:`StorageConfigError`) propagate.
    """
    if name == DYNAMIC_BACKEND:
        from engine.cache.storage.dynamic import load_dynamic_backend

        backend = load_dynamic_backend(config, load_backend_class)
    else:
        backend = load_backend_class(*_BACKENDS[check_backend_name(name)])(config)
    if host_pool is not None:
        try:
            backend.register_mem_pool_host(host_pool)
        except Exception:
            backend.close()
            raise
    return backend
