"""io backend registry (``--hicache-io-backend``): ``direct`` and ``kernel`` are built in; others register by
name. ``resolve_layout`` applies upstream's layout / io-backend corrections from what each backend declares.
"""

from __future__ import annotations

import logging

import torch

from engine.cache.config import MEM_LAYOUTS
from engine.cache.io_backends.base import IOBackend
from engine.cache.io_backends.direct import DirectIO
from engine.cache.io_backends.kernel import KernelIO

logger = logging.getLogger(__name__)

FALLBACK = "direct"
_BACKENDS: dict[str, type[IOBackend]] = {}


def register_io_backend(name: str, cls: type[IOBackend]) -> None:
    """Make ``cls`` available as ``name``; re-registering a name replaces it."""
    if not (isinstance(cls, type) and issubclass(cls, IOBackend)):
        raise TypeError(f"io backend {name!r} must subclass IOBackend, got {cls!r}")
    _BACKENDS[name] = cls


def get_io_backend(name: str) -> type[IOBackend]:
    """The backend class registered as ``name``; raises ``ValueError`` listing the registered names."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"hicache_io_backend: unsupported io backend {name!r}; registered: {sorted(_BACKENDS)}"
        ) from None


def resolve_layout(
    layout: str, io_backend: str, storage_backend: str | None, device: torch.device | str = "cpu"
) -> tuple[str, str]:
    """Upstream's layout / io-backend corrections for a device pool on ``device``; returns
    ``(layout, io_backend)``, logging a warning for each change.

    1. A backend that cannot run here (``kernel`` without CUDA or ``TRITON_INTERPRET=1``) -> ``direct``.
    2. ``mooncake`` + ``layer_first`` -> ``page_first`` when the backend copies it, else
       ``page_first_direct`` (server_args).
    3. A layout the backend cannot copy -> its substitute (``page_first`` + ``direct`` ->
       ``page_first_direct``; HiRadixCache init).

    Upstream also switches ``page_first_direct`` + ``kernel`` to ``direct``; our kernel copies that layout,
    so it stays. Refused (``ValueError``): an unknown layout or io backend, or a layout the backend neither
    copies nor substitutes.
    """
    if layout not in MEM_LAYOUTS:
        raise ValueError(f"hicache_mem_layout: unsupported layout {layout!r}")
    cls = get_io_backend(io_backend)
    reason = cls.unavailable_reason(torch.device(device))
    if reason is not None:
        logger.warning("%s io backend is not available (%s); using %s", io_backend, reason, FALLBACK)
        io_backend, cls = FALLBACK, get_io_backend(FALLBACK)
    if storage_backend == "mooncake" and layout == "layer_first":
        layout = "page_first" if "page_first" in cls.layouts else "page_first_direct"
        logger.warning(
            "mooncake storage needs a page-first layout; switching hicache_mem_layout to %s", layout
        )
    if layout not in cls.layouts:
        if layout not in cls.substitutes:
            raise ValueError(
                f"hicache_mem_layout: {layout!r} is not supported by the {io_backend} io backend"
            )
        substitute = cls.substitutes[layout]
        logger.warning(
            "%s layout is not supported by the %s io backend; using %s", layout, io_backend, substitute
        )
        layout = substitute
    return layout, io_backend


register_io_backend("direct", DirectIO)
register_io_backend("kernel", KernelIO)

__all__ = ["IOBackend", "DirectIO", "KernelIO", "get_io_backend", "register_io_backend", "resolve_layout"]
