"""Backends that move KV pages from a prefill pool into a decode pool (``--disaggregation-transfer-backend``).

* ``mooncake``: Mooncake's real ``TransferEngine`` (P2P handshake, no etcd; TCP here, RDMA with NICs).
  Both sides register every layer's K and V buffer once; P writes its pages straight into the pages D
  reserved with ``batch_transfer_sync_write``, one write per run of consecutive pages per buffer (push
  model, as SGLang's mooncake/conn.py). Between pools of different tp, a write moves a share of the heads:
  one entry per token and buffer, or one entry through the staging buffers (``staging.py``).
* ``fake``: the same contract with the KV bytes carried over the ZMQ side channel instead of RDMA
  (upstream's moves nothing; this one moves the bytes so the contract tests check them: a decision in
  docs/architecture.md).
* ``nixl``: NVIDIA's NIXL agent with its UCX backend (``NixlTransport``): both sides register their pool
  buffers with an agent, D's agent metadata travels in its descriptor (the side channel's ``Register``), and
  P writes the same entries as Mooncake with a notification naming the room (as SGLang's nixl/conn.py).
  UCX's transports come from ``UCX_*`` env vars; the defaults set here: ``engine.nixl_common.ucx_defaults``.
"""

from __future__ import annotations

import base64
import importlib.util
import logging
import os
import uuid
from typing import Protocol

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation.base import KVLayout, TransferBackendError, contiguous_runs
from engine.disaggregation.channel import Channel
from engine.disaggregation.staging import (
    StagingArea,
    head_write_list,
    pack,
    page_share_bytes,
    scatter,
    share_bytes,
)
from engine.nixl_common import NixlUnavailable, make_agent, ucx_defaults, wait_xfer

logger = logging.getLogger(__name__)
MAX_BATCH = 1024  # entries per batch_transfer_sync_write (0.3.13 returns -1 for 4096; 2048 works)


class TransferFailed(RuntimeError):
    """One write towards a decode peer failed; the message is the room's failure reason."""


class Transport(Protocol):
    """What a PD transfer needs from a transport (one per ``PrefillTransfer`` / ``DecodeTransfer``).

    Built as ``cls(host, pool, layout, ib_device, staging)`` with the pool's buffers (and the staging
    buffer, if any) registered; raises ``TransferBackendError`` when it cannot run here. On D,
    ``descriptor()`` is what the decode registers at each prefill (JSON; the ``Register`` message); on P,
    ``write`` gets that descriptor plus ``"endpoint"`` (the decode's side channel) as ``peer``.
    ``uses_side_channel``: the KV bytes travel as ``kv`` side-channel frames (``channel`` is set to the
    transfer's ``Channel`` before use, and D's receive thread hands those frames to ``on_data``).
    """

    name: str
    stages: bool  # can write a share of heads into the peer's staging buffer (``staging.py``)
    uses_side_channel: bool

    def descriptor(self) -> dict: ...

    def write(
        self,
        peer: dict,
        peer_layout: KVLayout,
        src: torch.Tensor,
        dst: torch.Tensor,
        room: int,
        share: dict | None = None,
    ) -> None:
        """Write P's pages ``src`` into the peer's pages ``dst`` (int64 ``(n,)`` each; ``share``: only those
        heads, for pools of different tp). Blocks until written; raises ``TransferFailed``."""

    def on_data(self, header: dict, payloads: list) -> None: ...

    def drain(self) -> None:
        """Take what the transport itself delivered to this side (NIXL's notifications); called on the side
        channel's tick (about every 0.2 s) on both sides. Never blocks."""

    def close(self) -> None: ...


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
    uses_side_channel = False
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
            srcs, dsts, lens = staged_write_list(self._pool, self._layout, self.staging, peer, src, share)
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

    def on_data(self, header: dict, payloads: list) -> None:
        raise RuntimeError(
            "the mooncake backend receives KV through the transfer engine, not the side channel"
        )

    def drain(self) -> None:
        pass

    def close(self) -> None:
        self.engine.batch_unregister_memory(self._ptrs)


def batched_write(engine, session_id: str, srcs: list[int], dsts: list[int], lens: list[int]) -> int:
    """``batch_transfer_sync_write`` in batches of at most ``MAX_BATCH`` entries; first rc < 0, else 0.

    A batch that fails is sent once more before its rc is returned: a write puts the same bytes at the same
    addresses, so a second try is safe, and the TCP transport's first write to a peer that has just started
    can fail while its connection is set up (seen as a rare rc -1 on a freshly restarted decode). A dead
    peer fails both tries at once (connection refused), so a killed decode still fails its request fast."""
    for i in range(0, len(srcs), MAX_BATCH):
        j = i + MAX_BATCH
        rc = engine.batch_transfer_sync_write(session_id, srcs[i:j], dsts[i:j], lens[i:j])
        if rc < 0:
            logger.warning("Mooncake write to %s failed (rc %d); sending the batch once more", session_id, rc)
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


NIXL_WRITE_TIMEOUT_S = 30.0  # a NIXL write not DONE by then fails (a dead peer's TCP errors come sooner)


class NixlTransport:
    """A NIXL agent (UCX backend) on ``host`` with the pool's 2 x num_layers buffers (and the staging buffer)
    registered. ``descriptor()`` is ``{"agent_name", "agent_metadata"}`` (base64 of the agent's metadata,
    plus ``staging_ptr``); P loads a decode's metadata on its first write to it (``add_remote_agent``) and
    writes the entries Mooncake would (one per run of pages per buffer, or per token and head share, or one
    staged entry), posted as one NIXL WRITE with the notification ``b"<room>"`` (as SGLang's nixl/conn.py),
    and waits until NIXL reports it DONE. D drains those notifications (``drain``; ``notified`` counts them
    per room): a room's completion is still P's Success on the side channel, sent after the write is DONE.
    Raises ``TransferBackendError`` when nixl or its UCX plugin cannot load."""

    name = "nixl"
    uses_side_channel = False
    stages = True

    def __init__(
        self,
        host: str,
        pool: DeviceKVPool,
        layout: KVLayout,
        ib_device: str | None = None,
        staging: StagingArea | None = None,
    ) -> None:
        flag = "--disaggregation-transfer-backend nixl"
        added = ucx_defaults(host)
        if added:
            logger.info("NIXL: UCX defaults set (unset before): %s", added)
        self.agent_name = f"kvfleet-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.agent = make_agent(self.agent_name, ["UCX"], flag)
        except NixlUnavailable as exc:
            raise TransferBackendError(str(exc)) from exc
        self._layout, self._pool, self.staging = layout, pool, staging
        self._mem, self._dev = _mem_type(pool)
        ptrs = [*layout.k_ptrs, *layout.v_ptrs]
        regions = [(p, layout.buffer_bytes, self._dev, "") for p in ptrs]
        if staging is not None:
            regions.append((staging.ptr, staging.size, 0, ""))  # the staging buffer is host memory
        try:
            self._registered = self.agent.register_memory(regions, self._mem)
        except Exception as exc:
            raise TransferBackendError(
                f"{flag}: NIXL could not register the KV pool buffers ({exc})"
            ) from exc
        self._metadata = base64.b64encode(self.agent.get_agent_metadata()).decode("ascii")
        self._peers: dict[str, str] = {}  # descriptor agent name -> name NIXL loaded it as
        self.bytes_sent = 0  # KV bytes of the writes NIXL reported DONE
        self.notified: dict[int, int] = {}  # D: notifications received per room (drain)

    def descriptor(self) -> dict:
        staging = {"staging_ptr": self.staging.ptr} if self.staging is not None else {}
        return {"agent_name": self.agent_name, "agent_metadata": self._metadata, **staging}

    def _remote(self, peer: dict) -> str:
        name = peer["agent_name"]
        loaded = self._peers.get(name)
        if loaded is None:
            try:
                got = self.agent.add_remote_agent(base64.b64decode(peer["agent_metadata"]))
            except Exception as exc:
                raise TransferFailed(f"NIXL could not load decode agent {name}'s metadata ({exc})") from exc
            # nixl 1.5.1 returns the name as bytes; check_remote_xfer_done / initialize_xfer want str
            loaded = got.decode() if isinstance(got, bytes) else got
            self._peers[name] = loaded
        return loaded

    def write(
        self,
        peer: dict,
        peer_layout: KVLayout,
        src: torch.Tensor,
        dst: torch.Tensor,
        room: int,
        share: dict | None = None,
    ) -> None:
        """As ``MooncakeTransport.write``: the same entries, posted as one NIXL WRITE to the peer's agent with
        the notification ``b"<room>"``; raises ``TransferFailed`` when NIXL reports an error or the write is
        not DONE within ``NIXL_WRITE_TIMEOUT_S``."""
        if share is not None and share.get("staging") is not None and self.staging is not None:
            srcs, dsts, lens = staged_write_list(self._pool, self._layout, self.staging, peer, src, share)
            mem, dev = "DRAM", 0
        elif share is not None:
            srcs, dsts, lens = head_write_list(
                self._layout, peer_layout, src, dst, share["src_head"], share["dst_head"], share["n"]
            )
            mem, dev = self._mem, self._dev
        else:
            srcs, dsts, lens = mooncake_write_list(self._layout, peer_layout, src, dst)
            mem, dev = self._mem, self._dev
        if not srcs:
            return
        remote = self._remote(peer)
        local = self.agent.get_xfer_descs([(s, n, dev) for s, n in zip(srcs, lens, strict=True)], mem)
        far = self.agent.get_xfer_descs([(d, n, dev) for d, n in zip(dsts, lens, strict=True)], mem)
        try:
            handle = self.agent.initialize_xfer("WRITE", local, far, remote, str(room).encode())
        except Exception as exc:
            raise TransferFailed(f"NIXL could not prepare a write to decode agent {remote} ({exc})") from exc
        try:
            self._wait(handle, remote)
        except TransferFailed:
            self._forget(peer["agent_name"])
            raise
        finally:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception as exc:  # a handle still in flight (timeout) may refuse release
                logger.warning("NIXL: could not release a write handle (%s)", exc)
        self.bytes_sent += sum(lens)

    def _wait(self, handle, remote: str) -> None:
        """Post ``handle`` and poll it until DONE; raises ``TransferFailed`` on NIXL's error (a dead peer:
        ``NIXL_ERR_REMOTE_DISCONNECT`` at once) or after ``NIXL_WRITE_TIMEOUT_S``."""
        try:
            state = wait_xfer(self.agent, handle, NIXL_WRITE_TIMEOUT_S)
        except TimeoutError:
            raise TransferFailed(
                f"NIXL write to decode agent {remote} not done after {NIXL_WRITE_TIMEOUT_S} s"
            ) from None
        except Exception as exc:  # nixl's bindings raise their own errors (nixlRemoteDisconnectError, ...)
            raise TransferFailed(f"NIXL write to decode agent {remote} failed ({exc})") from exc
        if state != "DONE":
            raise TransferFailed(f"NIXL write to decode agent {remote} failed ({state})")

    def _forget(self, name: str) -> None:
        """Drop a decode agent after a failed write (a restarted decode has a new agent name)."""
        loaded = self._peers.pop(name, None)
        if loaded is not None:
            try:
                self.agent.remove_remote_agent(loaded)
            except Exception as exc:
                logger.debug("NIXL: removing remote agent %s: %s", loaded, exc)

    def drain(self) -> None:
        """D: take the notifications that arrived (``b"<room>"`` per write) and count them in ``notified``;
        called from the side channel's tick, so the agent's list does not grow."""
        for msgs in self.agent.get_new_notifs().values():
            for msg in msgs:
                try:
                    room = int(msg)
                except ValueError:
                    continue
                self.notified[room] = self.notified.get(room, 0) + 1
        if len(self.notified) > 4096:  # keep the newest rooms only
            for room in list(self.notified)[:-2048]:
                del self.notified[room]

    def on_data(self, header: dict, payloads: list) -> None:
        raise RuntimeError("the nixl backend receives KV through NIXL, not the side channel")

    def close(self) -> None:
        for name in self._peers.values():
            try:
                self.agent.remove_remote_agent(name)
            except Exception as exc:
                logger.debug("NIXL: removing remote agent %s: %s", name, exc)
        self._peers.clear()
        try:
            self.agent.deregister_memory(self._registered)
        except Exception as exc:
            logger.debug("NIXL: deregistering the pool: %s", exc)


def _mem_type(pool: DeviceKVPool) -> tuple[str, int]:
    """NIXL's memory type and device id of the pool's buffers: ``("VRAM", cuda index)`` or ``("DRAM", 0)``."""
    buf = pool.k_buffer[0]
    if buf.is_cuda:
        return "VRAM", buf.device.index or 0
    return "DRAM", 0


def staged_write_list(
    pool: DeviceKVPool, layout: KVLayout, staging: StagingArea, peer: dict, src: torch.Tensor, share: dict
) -> tuple[list[int], list[int], list[int]]:
    """Pack the share into this side's staging buffer (from its start: one transfer thread writes one
    share at a time); the one entry that writes it to its place in the peer's staging buffer (the
    room's region there, past the pages of earlier chunks: ``share["page_offset"]``). Raises
    ``TransferFailed`` when the share does not fit here."""
    nbytes = share_bytes(layout, len(src), share["n"])
    if nbytes > staging.size:
        raise TransferFailed(
            f"the prefill's staging buffer ({staging.size} bytes) cannot hold a {nbytes}-byte "
            "share; raise SGLANG_DISAGG_STAGING_POOL_SIZE_MB"
        )
    pack(pool, staging.region(0, nbytes), src, share["src_head"], share["n"])
    before = share.get("page_offset", 0) * page_share_bytes(layout, share["n"])
    return [staging.ptr], [peer["staging_ptr"] + share["staging"] + before], [nbytes]


class FakeTransport:
    """Carries the KV bytes over the side channel: ``write`` sends one frame per buffer, ``on_data`` (on D,
    called by the receive thread, in order before the room's status) copies them into the given pages."""

    name = "fake"
    uses_side_channel = True
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
        self.channel: Channel | None = None  # set by the transfer: the Channel the frames travel on
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
        channel = self.channel
        if channel is None:
            raise TransferFailed("the fake transport has no side channel yet (the transfer sets it)")
        if share is not None:  # the share's heads, packed; the decode scatters them into its pages
            region = torch.empty(share_bytes(self._layout, len(src), share["n"]), dtype=torch.uint8)
            pack(self._pool, region, src, share["src_head"], share["n"])
            header = {"type": "kv", "room": room, "dst_pages": dst.tolist(), "share": share}
            channel.send(peer["endpoint"], header, [region.numpy()])
            self.bytes_sent += region.nbytes
            return
        frames = [
            # as bytes: numpy has no bfloat16 / float8 dtype
            self._paged(b).index_select(0, src).view(torch.uint8).numpy()
            for b in (*self._pool.k_buffer, *self._pool.v_buffer)
        ]
        channel.send(peer["endpoint"], {"type": "kv", "room": room, "dst_pages": dst.tolist()}, frames)
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

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


def nixl_installed() -> bool:
    """Whether the ``nixl`` package can be imported here (without importing it)."""
    return importlib.util.find_spec("nixl") is not None


def transport_class(backend: str) -> type[Transport]:
    """The transport class for ``--disaggregation-transfer-backend``; raises ``TransferBackendError``."""
    if backend == "mooncake":
        return MooncakeTransport
    if backend == "fake":
        return FakeTransport
    if backend == "nixl":
        if not nixl_installed():
            raise TransferBackendError(
                "--disaggregation-transfer-backend nixl: the nixl package is not installed on this host; "
                "install nixl and nixl-cu13 with pip --no-deps (make venv does) or use mooncake"
            )
        return NixlTransport
    raise TransferBackendError(
        f"--disaggregation-transfer-backend {backend!r} is not one of: mooncake, fake, nixl"
    )
