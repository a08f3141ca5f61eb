"""The ``dynamic`` backend loader: a user's HiCacheStorage subclass named in ``extra_config``.

Follows SGLang's dynamic backend (docs/upstream.md H6): ``extra_config`` must hold ``backend_name``,
``module_path`` and ``class_name`` (:class:`StorageConfigError`, a ``ValueError``, naming the missing
field otherwise); optional ``interface_v1`` (truthy) makes the cache use the zero-copy v1 methods. The
class is instantiated as ``cls(storage_config, kwargs)`` where ``kwargs`` is ``extra_config`` without
the four loader fields.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.cache.storage.base import HiCacheStorage, HiCacheStorageConfig, StorageConfigError

_REQUIRED = ("backend_name", "module_path", "class_name")
_LOADER_FIELDS = (*_REQUIRED, "interface_v1")


def load_dynamic_backend(
    config: HiCacheStorageConfig, load_class: Callable[[str, str], type[HiCacheStorage]]
) -> HiCacheStorage:
    """Import and instantiate the class ``extra_config`` names.

    ``load_class(module_path, class_name)`` imports and type-checks it (ImportError / TypeError naming
    the class). Raises :class:`StorageConfigError` for a missing or non-string loader field.
    """
    extra = config.extra_config
    for name in _REQUIRED:
        value = extra.get(name)
        if not value or not isinstance(value, str):
            raise StorageConfigError(
                f"extra_config.{name} is required for the dynamic storage backend (a non-empty string)"
            )
    cls = load_class(extra["module_path"], extra["class_name"])
    kwargs = {k: v for k, v in extra.items() if k not in _LOADER_FIELDS}
    backend = cls(config, kwargs)  # type: ignore[call-arg]  # dynamic classes take (config, kwargs), as upstream's
    if "interface_v1" in extra:
        backend.supports_v1 = bool(extra["interface_v1"])
    return backend
