"""Backends that move KV pages from a prefill pool into a decode pool (``--disaggregation-transfer-backend``).

* ``mooncake``: Mooncake's real ``TransferEngine`` (P2P handshake, no etcd; TCP here, RDMA with NICs).
  Both sides register every layer's K and V buffer once; P writes its pages straight into the pages D
  reserved with ``batch_transfer_sync_write``, one write per run of consecutive pages per buffer (push
  model, as SGLang's mooncake/conn.py). Between pools of different tp, a write moves a share of the heads:
  one entry per token and buffer, or one entry through the staging buffers (``staging.py``).
* ``fake``: the same contract with the KV bytes carried over the ZMQ side channel instead of RDMA
  (upstream's moves nothing; this one moves the bytes so the contract tests check them: a decision in
  docs/architecture.md).
* ``nixl``: refused with a ``TransferBackendError`` that says why.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation.base import KVLayout, TransferBackendError, contiguous_runs
from engine.disaggregation.staging import (
    StagingArea,
    head_write_list,
    pack,
    page_share_bytes,
    scatter,
    share_bytes,
)

logger = logging.getLogger(__name__)
MAX_BATCH = 1024  # entries per batch_transfer_sync_write (0.3.13 returns -1 for 4096; 2048 works)


class TransferFailed(RuntimeError):
    """One write towards a decode peer failed; the message is the room's failure reason."""


def open_transfer_engine(host: str, flag: str, ib_device: str | None = None):
    """A Mooncake ``TransferEngine`` initialised on ``host`` (P2P handshake, no metadata server; protocol
    ``MOONCAKE_PROTOCOL``, default tcp) and its session id ``"host:rpc_port"``, which peers pass to
    ``batch_transfer_sync_write``. Shared by the PD KV transport and the EPD embedding transfer
    (``engine/server/encoder_transfer.py``). Raises ``TransferBackendError`` naming ``flag`` when the
    engine cannot load or initialise."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferBackendError(
            f"{flag}: cannot load Mooncake's TransferEngine ({exc}); "
            "install mooncake-transfer-engine-non-cuda (requirements.txt) and libibverbs1"
        ) from exc
    protocol = os.environ.get("MOONCAKE_PROTOCOL", "tcp")
    if protocol == "tcp" and ib_device:
        logger.info("--disaggregation-ib-device %s is unused: Mooncake runs over TCP here", ib_device)
    device = "" if protocol == "tcp" else (ib_device or "")
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise TransferBackendError(
            f"{flag}: Mooncake TransferEngine.initialize({host!r}, {protocol!r}) returned {rc}"
        )
    return engine, f"{host}:{engine.get_rpc_port()}"


class MooncakeTransport:
    """A ``TransferEngine`` on ``host`` with the pool's 2 x num_layers buffers registered.

    ``descriptor()`` is ``{"session_id": "host:rpc_port"}``, which the peer passes to ``write``.
    Raises ``TransferBackendError`` when the engine cannot load or initialise.
    """

    name = "mooncake"
    stages = True  # writes a share into the peer's staging buffer when the transfer info gives a region

    def __init__(
        self,
        host: str,
        pool: DeviceKVPool,
        layout: KVLayout,
        ib_device: str | None = None,
        staging: StagingArea | None = None,
    ) -> None:
        self.engine, self.session_id = open_transfer_engine(
            host, "--disaggregation-transfer-backend mooncake", ib_device
        )
        self._layout = layout
        self._ptrs = [*layout.k_ptrs, *layout.v_ptrs]
        self._pool, self.staging = pool, staging
        self.bytes_sent = 0  # KV bytes handed to batch_transfer_sync_write that it wrote (rc >= 0)
        sizes = [layout.buffer_bytes] * len(self._ptrs)
        if staging is not None:
            self._ptrs.append(staging.ptr)
            sizes.append(staging.size)
        rc = self.engine.batch_register_memory(self._ptrs, sizes)
        if rc != 0:
            raise TransferBackendError(f"Mooncake could not register the KV pool buffers (rc {rc})")

    def descriptor(self) -> dict:
        staging = {"staging_ptr": self.staging.ptr} if self.staging is not None else {}
        return {"session_id": self.session_id, **staging}

    def write(
        self,
        peer: dict,
        peer_layout: KVLayout,
        src: torch.Tensor,
        dst: torch.Tensor,
        room: int,
        share: dict | None = None,
    ) -> None:
        """Write pages ``src`` into the peer pages ``dst`` (int64 ``(n,)``); raises ``TransferFailed``.

        ``share`` (pools of different tp): ``{"src_head", "dst_head", "n"}`` moves only those heads, one
        entry per token and buffer; with ``"staging"`` (an offset into the peer's staging buffer) and a
        staging buffer here, the heads are packed here and written in one entry (the peer scatters them)."""
        if share is not None and share.get("staging") is not None and self.staging is not None:
            srcs, dsts, lens = self._staged_write(peer, src, share)
        elif share is not None:
            srcs, dsts, lens = head_write_list(
                self._layout, peer_layout, src, dst, share["src_head"], share["dst_head"], share["n"]
            )
        else:
            srcs, dsts, lens = mooncake_write_list(self._layout, peer_layout, src, dst)
        if not srcs:
            return
        rc = batched_write(self.engine, peer["session_id"], srcs, dsts, lens)
        if rc < 0:
            raise TransferFailed(f"Mooncake write to decode session {peer['session_id']} failed (rc {rc})")
        self.bytes_sent += sum(lens)

    def _staged_write(self, peer: dict, src: torch.Tensor, share: dict) -> tuple[list, list, list]:
        """Pack the share into this side's staging buffer (from its start: one transfer thread writes one
        share at a time); the one entry that writes it to its place in the peer's staging buffer (the
        room's region there, past the pages of earlier chunks: ``share["page_offset"]``)."""
        nbytes = share_bytes(self._layout, len(src), share["n"])
        if nbytes > self.staging.size:
            raise TransferFailed(
                f"the prefill's staging buffer ({self.staging.size} bytes) cannot hold a {nbytes}-byte "
                "share; raise SGLANG_DISAGG_STAGING_POOL_SIZE_MB"
            )
        pack(self._pool, self.staging.region(0, nbytes), src, share["src_head"], share["n"])
        before = share.get("page_offset", 0) * page_share_bytes(self._layout, share["n"])
        return [self.staging.ptr], [peer["staging_ptr"] + share["staging"] + before], [nbytes]

    def on_data(self, header: dict, payloads: list) -> None:
        raise RuntimeError(
            "the mooncake backend receives KV through the transfer engine, not the side channel"
        )

    def close(self) -> None:
        self.engine.batch_unregister_memory(self._ptrs)


def batched_write(engine, session_id: str, srcs: list[int], dsts: list[int], lens: list[int]) -> int:
    """``batch_transfer_sync_write`` in batches of at most ``MAX_BATCH`` entries; first rc < 0, else 0."""
    for i in range(0, len(srcs), MAX_BATCH):
        j = i + MAX_BATCH
        rc = engine.batch_transfer_sync_write(session_id, srcs[i:j], dsts[i:j], lens[i:j])
        if rc < 0:
            return rc
    return 0


def mooncake_write_list(
    local: KVLayout, remote: KVLayout, src: torch.Tensor, dst: torch.Tensor
) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, byte lengths): one entry per run of pages per buffer."""
    s_pages, d_pages, runs = contiguous_runs(src, dst)
    pb = local.page_bytes
    srcs, dsts, lens = [], [], []
    for src_base, dst_base in zip(
        (*local.k_ptrs, *local.v_ptrs), (*remote.k_ptrs, *remote.v_ptrs), strict=True
    ):
        for s, d, n in zip(s_pages, d_pages, runs, strict=True):
            srcs.append(src_base + s * pb)
            dsts.append(dst_base + d * pb)
            lens.append(n * pb)
    return srcs, dsts, lens


class FakeTransport:
    """Carries the KV bytes over the side channel: ``write`` sends one frame per buffer, ``on_data`` (on D,
    called by the receive thread, in order before the room's status) copies them into the given pages."""

    name = "fake"
    stages = False  # a share's heads travel packed in one frame whatever the staging setting

    def __init__(
        self,
        host: str,
        pool: DeviceKVPool,
        layout: KVLayout,
        ib_device: str | None = None,
        staging: StagingArea | None = None,
    ) -> None:
        self._pool = pool
        self._layout = layout
        self.staging = staging
        self.channel = None  # set by the manager: the Channel the frames travel on
        self.bytes_sent = 0  # KV payload bytes of the frames handed to the channel

    def descriptor(self) -> dict:
        return {}

    def _paged(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(self._layout.num_pages, -1)

    def write(
        self,
        peer: dict,
        peer_layout: KVLayout,
        src: torch.Tensor,
        dst: torch.Tensor,
        room: int,
        share: dict | None = None,
    ) -> None:
        if not len(src):
            return
        if share is not None:  # the share's heads, packed; the decode scatters them into its pages
            region = torch.empty(share_bytes(self._layout, len(src), share["n"]), dtype=torch.uint8)
            pack(self._pool, region, src, share["src_head"], share["n"])
            header = {"type": "kv", "room": room, "dst_pages": dst.tolist(), "share": share}
            self.channel.send(peer["endpoint"], header, [region.numpy()])
            self.bytes_sent += region.nbytes
            return
        frames = [
            # as bytes: numpy has no bfloat16 / float8 dtype
            self._paged(b).index_select(0, src).view(torch.uint8).numpy()
            for b in (*self._pool.k_buffer, *self._pool.v_buffer)
        ]
        self.channel.send(peer["endpoint"], {"type": "kv", "room": room, "dst_pages": dst.tolist()}, frames)
        self.bytes_sent += sum(f.nbytes for f in frames)

    def on_data(self, header: dict, payloads: list) -> None:
        dst = torch.tensor(header["dst_pages"], dtype=torch.int64)
        self._layout.check_pages(dst, "dst_pages")
        share = header.get("share")
        if share is not None:
            region = torch.frombuffer(bytearray(payloads[0]), dtype=torch.uint8)
            scatter(self._pool, region, dst, share["dst_head"], share["n"])
            return
        for buf, data in zip((*self._pool.k_buffer, *self._pool.v_buffer), payloads, strict=True):
            paged = self._paged(buf)
            rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(buf.dtype).view(len(dst), -1)
            paged.index_copy_(0, dst, rows)

    def close(self) -> None:
        pass


def transport_class(backend: str):
    """The transport class for ``--disaggregation-transfer-backend``; raises ``TransferBackendError``."""
    if backend == "mooncake":
        return MooncakeTransport
    if backend == "fake":
        return FakeTransport
    if backend == "nixl":
        if importlib.util.find_spec("nixl") is None:
            raise TransferBackendError(
                "--disaggregation-transfer-backend nixl: the nixl package is not installed on this host "
                "(it needs CUDA/UCX); use mooncake"
            )
        raise TransferBackendError(
            "--disaggregation-transfer-backend nixl: KVFleet has no NIXL transport yet; use mooncake"
        )
    raise TransferBackendError(
        f"--disaggregation-transfer-backend {backend!r} is not one of: mooncake, fake, nixl"
    )
