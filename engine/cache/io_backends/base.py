"""Interface of an io backend: whole-page copies between the L1 device pool and the L2 host pool.

Follows upstream's ``--hicache-io-backend`` split (docs/upstream.md H4): the cache controller asks for an
L2 -> L1 load one layer at a time (so the forward pass of layer ``i`` can start once layer ``i`` is in L1) and
for an L1 -> L2 backup of all layers at once. On CUDA, loads run on their own stream and each layer records an
event; :meth:`IOBackend.wait_loaded` makes the compute stream wait for that event only, so the host never
blocks on the copy and layer ``i``'s attention waits only for layer ``i``'s copy. Backups run on a second
stream and are complete when :meth:`IOBackend.backup` returns. On CPU every copy is synchronous.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Generic, TypeVar

import torch

from engine.cache.allocator import slots_to_pages
from engine.cache.device_pool import DeviceKVPool
from engine.cache.host_pool import HostKVPool

PlanT = TypeVar("PlanT")
"""What a backend precomputes for one transfer (:meth:`IOBackend.plan`)."""


class IOBackend(ABC, Generic[PlanT]):
    """Copies whole pages between ``device_pool`` and ``host_pool`` (same page size, layers, heads, dtype).

    ``layouts``: the host layouts the backend copies; ``substitutes``: for a layout it cannot copy, the one
    upstream switches to instead (with a warning, see ``resolve_layout``). Raises ``ValueError`` for
    mismatched pools or a host layout not in ``layouts``.
    """

    layouts: ClassVar[tuple[str, ...]] = ()
    substitutes: ClassVar[dict[str, str]] = {}

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run with a device pool on ``device`` (None when it can)."""
        return None

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool) -> None:
        name = type(self).__name__
        if host_pool.layout not in self.layouts:
            raise ValueError(f"{name}: unsupported layout {host_pool.layout!r}")
        same = (
            device_pool.page_size == host_pool.page_size
            and device_pool.num_layers == host_pool.num_layers
            and device_pool.num_kv_heads == host_pool.num_kv_heads
            and device_pool.row_dim == host_pool.head_dim
            and device_pool.dtype == host_pool.dtype
        )
        if not same:
            raise ValueError("device and host pools differ in page size, layers, heads, head dim or dtype")
        self.page_size = host_pool.page_size
        self.num_layers = host_pool.num_layers
        self.bytes_per_token = device_pool.bytes_per_token
        self.device = device_pool.device
        cuda = self.device.type == "cuda"
        self.load_stream = torch.cuda.Stream(self.device) if cuda else None
        self.write_stream = torch.cuda.Stream(self.device) if cuda else None

    def pages(
        self, device_indices: torch.Tensor, host_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Page numbers ``(device_pages, host_pages)`` of two equally long whole-page slot lists; raises
        ``ValueError`` when the lengths differ."""
        if len(device_indices) != len(host_indices):
            raise ValueError(f"copy of {len(device_indices)} device slots to {len(host_indices)} host slots")
        return slots_to_pages(device_indices, self.page_size), slots_to_pages(host_indices, self.page_size)

    # -- L2 -> L1 ----------------------------------------------------------------------------------------
    def compute_mark(self) -> torch.cuda.Event | None:
        """On the scheduler thread, before a load is queued: an event after the work issued so far on the
        compute stream (the load must not overwrite slots that work still reads); None on CPU."""
        if self.load_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @abstractmethod
    def plan(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> PlanT:
        """Whatever the backend precomputes for one transfer (reused for every layer of it), issued on the
        current stream."""

    def prepare_load(
        self, device_indices: torch.Tensor, host_indices: torch.Tensor, after: torch.cuda.Event | None
    ) -> PlanT:
        """The plan of an L2 -> L1 load, made on the load stream behind ``after`` (see
        :meth:`compute_mark`)."""
        if self.load_stream is None:
            return self.plan(device_indices, host_indices)
        with torch.cuda.stream(self.load_stream):
            if after is not None:
                self.load_stream.wait_event(after)
            return self.plan(device_indices, host_indices)

    def load_layer(self, layer: int, plan: PlanT) -> torch.cuda.Event | None:
        """Issue the L2 -> L1 copy of ``layer`` on the load stream; returns what :meth:`wait_loaded` needs:
        a CUDA event, or None on CPU where the copy is already done."""
        if self.load_stream is None:
            self._load_layer(layer, plan)
            return None
        with torch.cuda.stream(self.load_stream):
            self._load_layer(layer, plan)
            event = torch.cuda.Event()
            event.record(self.load_stream)
        return event

    @property
    def copy_on_wait(self) -> bool:
        """Whether :meth:`load_layer` copies synchronously on the calling thread and may run for different
        layers of one plan on two threads at once, so a thread that waits for a layer may copy it itself
        (the cache controller's ``wait_layer``). False here: a backend opts in."""
        return False

    @staticmethod
    def wait_loaded(ready: torch.cuda.Event | None) -> None:
        """Make the current (compute) stream wait for a :meth:`load_layer` result; no host block."""
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)

    @staticmethod
    def synchronize(ready: torch.cuda.Event | None) -> None:
        """Block the calling thread until a :meth:`load_layer` result is complete."""
        if ready is not None:
            ready.synchronize()

    @abstractmethod
    def _load_layer(self, layer: int, plan: PlanT) -> None:
        """Issue the copy of one layer on the current stream."""

    # -- L1 -> L2 ----------------------------------------------------------------------------------------
    def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """L1 -> L2 copy of every layer, complete (in host memory) on return."""
        if self.write_stream is None:
            self._backup(self.plan(device_indices, host_indices))
            return
        self.write_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.write_stream):
            self._backup(self.plan(device_indices, host_indices))
        self.write_stream.synchronize()

    @abstractmethod
    def _backup(self, plan: PlanT) -> None:
        """Issue the copy of every layer on the current stream."""

    # -- the copies alone (benchmarks) -------------------------------------------------------------------
    def issue_load(self, plan: PlanT) -> None:
        """Issue every layer's L2 -> L1 copy of ``plan`` on the current stream, with no load stream or event:
        the copy alone, as ``engine.bench.kernels`` times it."""
        for layer in range(self.num_layers):
            self._load_layer(layer, plan)

    def issue_backup(self, plan: PlanT) -> None:
        """Issue the L1 -> L2 copy of every layer of ``plan`` on the current stream, with no write stream or
        synchronisation: the copy alone, as ``engine.bench.kernels`` times it."""
        self._backup(plan)
