"""Interface of an attention backend over the paged L1 KV pool (SGLang's ``AttentionBackend`` split)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.model.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Stores each new token's K/V in the pool, then attends over all K/V of its sequence through slots.

    One instance serves every layer of a model: ``init_forward_metadata`` runs once per batch (index and mask
    preparation), ``forward`` once per layer.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare per-batch indices and masks shared by all layers."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:
        """Attention output ``(T, num_heads, head_dim)`` for ``q`` ``(T, num_heads, head_dim)``.

        ``k``/``v`` ``(T, num_kv_heads, head_dim)`` are the new tokens' keys/values (after RoPE); they are
        written to ``batch.out_cache_loc`` of layer ``layer_id`` before attention reads the pool.
        """
