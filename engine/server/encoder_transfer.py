"""EPD embedding transfer over Mooncake's TransferEngine (``--encoder-transfer-backend mooncake``).

Both sides open a TransferEngine with the PD KV transport's helper
(:func:`engine.disaggregation.transport.open_transfer_engine`: P2P handshake, TCP here) and register one host
buffer once, cut into fixed slots (:class:`BufferPool`):

* the language-only worker (:class:`EmbeddingReceiver`) takes a slot for a request, names it in its
  ``POST /encode`` (``transfer``: ``{"session_id", "addr", "capacity", "deadline"}``), reads the embeddings
  out of it after the encoder's HTTP answer and returns the slot;
* the encoder (:class:`EmbeddingSender`) copies the embeddings into one of its slots and writes them into the
  receiver's slot with ``batch_transfer_sync_write`` (the PD transport's ``batched_write``), in slot-sized
  chunks, before it answers.

A slot whose request ended without an answer from the encoder (a read timeout, a dropped connection: the
encoder may still write into it) is held back until ``deadline + LATE_WRITE_GRACE_S`` before it is reused;
the encoder writes nothing after ``deadline`` (unix seconds, the receiver's clock).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch

from engine.disaggregation.base import TransferBackendError
from engine.disaggregation.transport import batched_write, open_transfer_engine

logger = logging.getLogger(__name__)
FLAG = "--encoder-transfer-backend mooncake"
RECEIVE_SLOTS = int(os.environ.get("KVFLEET_EPD_RECEIVE_SLOTS", "4"))  # requests in flight per worker
SEND_SLOTS = 2  # staging slots per encoder; a request waits for one
LATE_WRITE_GRACE_S = 5.0


class BufferPool:
    """``slots`` slots of ``slot_bytes`` bytes in one host buffer registered with ``engine`` once.

    ``acquire`` hands out a slot index (waiting up to ``timeout_s`` for one), ``release`` returns it,
    ``release_at`` returns it once ``time.time()`` passes ``at`` (a slot a peer may still write into).
    Raises ``TransferBackendError`` when the buffer cannot be registered."""

    def __init__(self, engine, slots: int, slot_bytes: int) -> None:
        if slots < 1 or slot_bytes < 1:
            raise TransferBackendError(f"{FLAG}: buffer pool needs >= 1 slot of >= 1 byte")
        self.engine, self.slots, self.slot_bytes = engine, slots, slot_bytes
        self.buffer = torch.zeros(slots * slot_bytes, dtype=torch.uint8)
        self.base = self.buffer.data_ptr()
        rc = engine.register_memory(self.base, slots * slot_bytes)
        if rc != 0:
            raise TransferBackendError(
                f"{FLAG}: Mooncake could not register {slots * slot_bytes} bytes (rc {rc})"
            )
        self._free = list(range(slots))
        self._held_back = 0
        self._cond = threading.Condition()

    def acquire(self, timeout_s: float) -> int:
        """A free slot's index; ``TimeoutError`` when none frees up within ``timeout_s``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout_s):
                raise TimeoutError(f"all {self.slots} embedding transfer buffers busy for {timeout_s:g} s")
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._cond:
            assert slot not in self._free, f"slot {slot} released twice"
            self._free.append(slot)
            self._cond.notify()

    def release_at(self, slot: int, at: float) -> None:
        """Return ``slot`` once the wall clock passes ``at`` (unix seconds), from a timer thread."""
        with self._cond:
            self._held_back += 1

        def _back() -> None:
            with self._cond:
                self._held_back -= 1
            self.release(slot)

        timer = threading.Timer(max(0.0, at - time.time()), _back)
        timer.daemon = True
        timer.start()

    def addr(self, slot: int) -> int:
        return self.base + slot * self.slot_bytes

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of ``slot`` (uint8, shares the registered memory)."""
        if not 0 <= nbytes <= self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self.slot_bytes}-byte slot")
        start = slot * self.slot_bytes
        return self.buffer[start : start + nbytes]

    def stats(self) -> dict:
        """``{"slots", "free", "held_back", "slot_bytes"}``: ``free == slots`` when nothing is in use."""
        with self._cond:
            return {
                "slots": self.slots,
                "free": len(self._free),
                "held_back": self._held_back,
                "slot_bytes": self.slot_bytes,
            }

    def close(self) -> None:
        self.engine.unregister_memory(self.base)


class EmbeddingReceiver:
    """The language-only side: a TransferEngine on ``host`` and ``RECEIVE_SLOTS`` slots, each big enough for
    one request's embeddings (``slot_bytes``: images per request x tokens per image x hidden x 4)."""

    def __init__(self, host: str, slot_bytes: int, slots: int = RECEIVE_SLOTS) -> None:
        self.engine, self.session_id = open_transfer_engine(host, FLAG)
        self.pool = BufferPool(self.engine, slots, slot_bytes)

    def target(self, slot: int, deadline: float) -> dict:
        """The ``transfer`` object of ``POST /encode`` that points the encoder at ``slot``."""
        return {
            "session_id": self.session_id,
            "addr": self.pool.addr(slot),
            "capacity": self.pool.slot_bytes,
            "deadline": deadline,
        }

    def read(self, slot: int, shape: list[int]) -> torch.Tensor:
        """A float32 copy of the ``shape`` embeddings the encoder wrote into ``slot``; ``ValueError`` when
        they would not fit it."""
        n = 1
        for d in shape:
            n *= int(d)
        return self.pool.view(slot, 4 * n).view(torch.float32).reshape(shape).clone()

    def close(self) -> None:
        self.pool.close()


class EmbeddingSender:
    """The encoder side: a TransferEngine on ``host`` and ``SEND_SLOTS`` staging slots of ``slot_bytes``."""

    def __init__(self, host: str, slot_bytes: int, slots: int = SEND_SLOTS) -> None:
        self.engine, self.session_id = open_transfer_engine(host, FLAG)
        self.pool = BufferPool(self.engine, slots, slot_bytes)

    def send(self, data: torch.Tensor, session_id: str, addr: int, timeout_s: float = 30.0) -> None:
        """Write ``data`` (any dtype, contiguous) to ``addr`` of the peer ``session_id`` through a staging
        slot, one slot-sized chunk at a time. Raises ``TimeoutError`` when no slot frees up and
        ``RuntimeError`` when a write fails."""
        raw = data.contiguous().view(-1).view(torch.uint8)
        slot = self.pool.acquire(timeout_s)
        try:
            step = self.pool.slot_bytes
            for off in range(0, raw.numel(), step):
                chunk = raw[off : off + step]
                self.pool.view(slot, chunk.numel()).copy_(chunk)
                rc = batched_write(
                    self.engine, session_id, [self.pool.addr(slot)], [addr + off], [chunk.numel()]
                )
                if rc < 0:
                    raise RuntimeError(f"Mooncake write to {session_id} failed (rc {rc})")
        finally:
            self.pool.release(slot)

    def close(self) -> None:
        self.pool.close()
