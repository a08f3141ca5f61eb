"""The runner seam: what the scheduler needs from a model runner, with the contract written once here.

:class:`engine.model.runner.ModelRunner` implements it; a test can drive the scheduler with any object that
does (a fake runner stands in for the model only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from engine.cache.device_pool import DeviceKVPool
    from engine.model.forward_batch import ForwardBatch


class Runner(Protocol):
    """Runs one forward pass over a batch whose KV lives in a device pool."""

    def forward(
        self, batch: ForwardBatch, kv_pool: DeviceKVPool, return_all_logits: bool = False
    ) -> torch.Tensor:
        """Float32 logits ``(num_seqs, vocab)`` for each sequence's last new token (``(T, vocab)`` with
        ``return_all_logits``). Writes the K/V of every new token into ``kv_pool`` at
        ``batch.out_cache_loc``; for layer ``i`` it reads cached KV only after the cache's
        ``wait_layer(i)`` (load-back overlaps the forward pass)."""
