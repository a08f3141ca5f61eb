"""The ``kernel`` io backend: one Triton launch moves a batch of scattered pages (``kernels.transfer``).

Follows upstream's GPU-assisted io (docs/upstream.md H4): page indices go to the device, the GPU reads and
writes the pinned host buffer directly, one launch per layer for a load (so each layer can be waited on
alone) and one launch for all layers of a backup. Copies every host layout (``layer_first``,
``page_first``, ``page_first_direct``; upstream's kernels lack ``page_first_direct`` and switch it to
``direct``). Runs with a CUDA device pool, or on any device under ``TRITON_INTERPRET=1`` (Triton's
interpreter; slow, for tests). The Triton parts of ``kernels`` are imported on first use, so an engine that
never selects this backend never imports Triton.
"""

from __future__ import annotations

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.cache.host_pool import HostKVPool
from engine.cache.io_backends.base import IOBackend
from kernels import unavailable_reason


class KernelIO(IOBackend[tuple[torch.Tensor, torch.Tensor]]):
    """Triton page copies. Raises ``ValueError`` as :class:`IOBackend`."""

    layouts = ("layer_first", "page_first", "page_first_direct")

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        return unavailable_reason(device)

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool) -> None:
        from kernels.transfer import PagedKV, layout_strides

        super().__init__(device_pool, host_pool)
        P, L = self.page_size, self.num_layers
        row = device_pool.num_kv_heads * device_pool.row_dim
        dev_tokens = device_pool.size + P
        self._device = PagedKV.from_strides(
            device_pool.kv_buffer, **layout_strides("layer_first", L, dev_tokens, P, row), row=row
        )
        self._host = PagedKV.from_strides(
            host_pool.kv_buffer, **layout_strides(host_pool.layout, L, host_pool.size, P, row), row=row
        )

    def plan(
        self, device_indices: torch.Tensor, host_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(device_pages, host_pages)``, both int64 on the device (the kernel reads them there)."""
        dev, host = self.pages(device_indices, host_indices)
        return dev.to(self.device), host.to(self.device)

    def _load_layer(self, layer: int, plan: tuple[torch.Tensor, torch.Tensor]) -> None:
        from kernels.transfer import copy_pages

        dev, host = plan
        copy_pages(self._host, self._device, host, dev, self.page_size, layer)

    def _backup(self, plan: tuple[torch.Tensor, torch.Tensor]) -> None:
        from kernels.transfer import copy_pages

        dev, host = plan
        copy_pages(self._device, self._host, dev, host, self.page_size, 0, self.num_layers)
