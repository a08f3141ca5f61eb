"""States, errors, timeouts and the KV layout shared by every PD transfer backend.

Follows SGLang's ``disaggregation/base/conn.py`` (``KVPoll``, ``KVTransferError``) and the timeouts of
``common/conn.py`` with upstream's env names and defaults (docs/upstream.md P1).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.cache.device_pool import DeviceKVPool


class DisaggregationMode(enum.StrEnum):
    """``--disaggregation-mode``: ``null`` (aggregated), ``prefill`` or ``decode``."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVPoll(enum.IntEnum):
    """State of one bootstrap room, upstream's numbering. A room only moves forward (``KVPOLL_TRANSITIONS``;
    ``RoomState.move`` checks it): Bootstrapping -> WaitingForInput (D's transfer info is at P) ->
    Transferring (P writes) -> Success, a state may be skipped, and any unfinished state may end Failed."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


P = KVPoll
KVPOLL_TRANSITIONS: dict[KVPoll, frozenset[KVPoll]] = {
    P.Bootstrapping: frozenset({P.WaitingForInput, P.Transferring, P.Success, P.Failed}),
    P.WaitingForInput: frozenset({P.Transferring, P.Success, P.Failed}),
    P.Transferring: frozenset({P.Success, P.Failed}),
    P.Success: frozenset(),
    P.Failed: frozenset(),
}
del P


class IllegalRoomTransition(RuntimeError):
    """A room was moved along an edge ``KVPOLL_TRANSITIONS`` does not have (a transfer-manager bug)."""


class KVTransferError(RuntimeError):
    """A room that ended Failed; ``bootstrap_room`` and ``reason`` as upstream's ``KVTransferError``."""

    def __init__(self, bootstrap_room: int, reason: str) -> None:
        super().__init__(f"KV transfer failed for bootstrap room {bootstrap_room}: {reason}")
        self.bootstrap_room = bootstrap_room
        self.reason = reason


class TransferBackendError(ValueError):
    """``--disaggregation-transfer-backend`` names an unknown backend or one that cannot run on this host."""


def _env_float(name: str, default: float, minimum: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    return max(value, minimum)


@dataclass(frozen=True)
class TransferTimeouts:
    """Timeouts and retry knobs in seconds. ``from_env`` reads upstream's env names; keywords override."""

    bootstrap_timeout_s: float = 300.0  # P: room Bootstrapping this long -> Failed
    waiting_timeout_s: float = 300.0  # D: room WaitingForInput this long -> ABORT to P, Failed
    heartbeat_interval_s: float = 5.0  # D: GET P's /health this often
    heartbeat_max_failure: int = 2  # D: misses in a row before P is declared dead
    bootstrap_query_retries: int = 15  # D: GET /route tries at first contact
    bootstrap_query_interval_s: float = 1.0  # D: pause between those tries
    unknown_room_timeout_s: float = 10.0  # P: D's info for a room P never opened -> Failed to D
    abort_ack_timeout_s: float = 15.0  # D: an ABORT not acknowledged this long -> Failed anyway
    info_ack_timeout_s: float = 2.0  # D: transfer info not acknowledged this long -> re-read P's bootstrap
    decode_ping_interval_s: float = 1.0  # P: ping each decode it has met over the side channel this often
    decode_dead_after_s: float = 3.0  # P: a decode silent this long is gone: the rooms it registered fail
    no_decode_grace_s: float = 0.5  # P: a room Bootstrapping this long while every decode P met is gone fails
    claim_grace_s: float = 2.0  # P: a room no decode claimed this long fails if a decode was found gone then

    @classmethod
    def from_env(cls, **overrides) -> TransferTimeouts:
        """Upstream env vars (``SGLANG_DISAGGREGATION_*``), then ``overrides`` (keyword = field name)."""
        values: dict[str, Any] = {
            "bootstrap_timeout_s": _env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0, 0.0),
            "waiting_timeout_s": _env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0, 0.0),
            "heartbeat_interval_s": _env_float("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", 5.0, 2.0),
            "heartbeat_max_failure": int(_env_float("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", 2, 1)),
        }
        unknown = set(overrides) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown timeout settings: {sorted(unknown)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32`` (the ``kv_cache_dtype`` string both sides compare)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVLayout:
    """Where a pool's pages live in memory.

    Page ``p`` of layer ``l`` is the ``page_bytes`` bytes at ``k_ptrs[l] + p * page_bytes`` (keys) and
    ``v_ptrs[l] + p * page_bytes`` (values); ``page_bytes = page_size * num_kv_heads * row_dim * itemsize``
    (``row_dim``: head_dim, plus int8's scale). ``kv_cache_dtype`` is the pool's format with its scale
    layout (``float32``, ``fp8_e4m3``, ``int8/per-token-head-bf16``): both sides must agree at first contact.
    ``num_pages`` counts page 0 (padding), so valid request pages are ``1 .. num_pages - 1``.
    ``num_kv_heads``: the heads the pool holds (a tensor-parallel rank's share), so a page's token ``t`` has
    head ``h`` at byte ``(t * num_kv_heads + h) * head_bytes`` of the page.
    """

    num_layers: int
    page_size: int
    page_bytes: int
    num_pages: int
    kv_cache_dtype: str
    k_ptrs: tuple[int, ...]
    v_ptrs: tuple[int, ...]
    num_kv_heads: int = 1

    @classmethod
    def from_pool(cls, pool: DeviceKVPool) -> KVLayout:
        for buf in (*pool.k_buffer, *pool.v_buffer):
            if not buf.is_contiguous():
                raise ValueError("device pool buffers must be contiguous to be registered for transfer")
        return cls(
            num_layers=pool.num_layers,
            page_size=pool.page_size,
            page_bytes=pool.page_size * pool.num_kv_heads * pool.row_dim * pool.dtype.itemsize,
            num_pages=pool.k_buffer[0].shape[0] // pool.page_size,
            kv_cache_dtype=pool.kv_format.layout_name,
            k_ptrs=tuple(b.data_ptr() for b in pool.k_buffer),
            v_ptrs=tuple(b.data_ptr() for b in pool.v_buffer),
            num_kv_heads=pool.num_kv_heads,
        )

    @property
    def head_bytes(self) -> int:
        """Bytes of one token's row of one KV head (head_dim, plus int8's scale, times the item size)."""
        return self.page_bytes // (self.page_size * self.num_kv_heads)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one layer's K (or V) buffer."""
        return self.num_pages * self.page_bytes

    def to_wire(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "page_size": self.page_size,
            "page_bytes": self.page_bytes,
            "num_pages": self.num_pages,
            "kv_cache_dtype": self.kv_cache_dtype,
            "k_ptrs": list(self.k_ptrs),
            "v_ptrs": list(self.v_ptrs),
            "num_kv_heads": self.num_kv_heads,
        }

    @classmethod
    def from_wire(cls, data: dict) -> KVLayout:
        return cls(**{**data, "k_ptrs": tuple(data["k_ptrs"]), "v_ptrs": tuple(data["v_ptrs"])})

    def mismatch(self, other: KVLayout) -> str | None:
        """Why pages of ``other`` cannot be written into this layout (or from it), else None. Pools of
        different tp hold different numbers of heads: then a head's bytes must agree instead of a page's."""
        size = "page_bytes" if self.num_kv_heads == other.num_kv_heads else "head_bytes"
        for field in ("page_size", "kv_cache_dtype", "num_layers", size):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return f"KV layout mismatch: {field} is {theirs} on the peer, {mine} here"
        return None

    def check_pages(self, pages: torch.Tensor, what: str) -> None:
        """Raise ``ValueError`` unless ``pages`` is a 1-D int64 tensor of request pages of this pool."""
        if pages.dtype != torch.int64 or pages.dim() != 1:
            raise ValueError(
                f"{what} must be a 1-D int64 tensor, got {pages.dtype} of shape {tuple(pages.shape)}"
            )
        if len(pages) and (int(pages.min()) < 1 or int(pages.max()) >= self.num_pages):
            raise ValueError(f"{what} must lie in [1, {self.num_pages - 1}], got {pages.tolist()[:8]}...")


def contiguous_runs(src: torch.Tensor, dst: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """Split page pairs into runs where both sides advance by one: (src starts, dst starts, run lengths).

    ``src``/``dst``: int64 ``(n,)`` page indices, same length. Merging runs turns n page writes per layer
    into one write per run (upstream's ``group_concurrent_contiguous``).
    """
    if len(src) == 0:
        return [], [], []
    breaks = ((src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)).nonzero().flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
    ends = torch.cat([breaks, torch.tensor([len(src)], dtype=torch.int64)])
    return src[starts].tolist(), dst[starts].tolist(), (ends - starts).tolist()
