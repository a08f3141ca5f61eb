"""Attention backend registry: ``torch`` (reference, CPU and CUDA) and ``triton`` (Triton kernels: CUDA, or
the CPU under ``TRITON_INTERPRET=1``) are built in; others register by name."""

from __future__ import annotations

from engine.model.attention.base import AttentionBackend
from engine.model.attention.torch_backend import TorchAttentionBackend
from engine.model.attention.triton_backend import TritonAttentionBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_attention_backend(name: str, cls: type[AttentionBackend]) -> None:
    """Make ``cls`` available as ``name``; re-registering a name replaces it."""
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"attention backend {name!r} must subclass AttentionBackend, got {cls!r}")
    _BACKENDS[name] = cls


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name``; raises ``ValueError`` listing the registered names."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(_BACKENDS)}") from None


register_attention_backend("torch", TorchAttentionBackend)
register_attention_backend("triton", TritonAttentionBackend)

__all__ = [
    "AttentionBackend",
    "get_attention_backend",
    "register_attention_backend",
    "TorchAttentionBackend",
    "TritonAttentionBackend",
]
