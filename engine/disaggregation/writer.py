"""P's transfer thread: writes the pages of the rooms queued to it into their decodes' pages, one room at a
time (``PageWriter``), then reports each room's end to its decodes.

Owned by ``prefill.PrefillTransfer``, which queues a room (``KVSender``) when it is paired and has pages to
write; the writer reaches the rest through ``WriterPort``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Protocol

import torch

from engine.disaggregation.base import KVLayout, KVPoll
from engine.disaggregation.common import TestDelay
from engine.disaggregation.sender import KVSender
from engine.disaggregation.staging import whole_share_mismatch
from engine.disaggregation.transport import TransferFailed, Transport

logger = logging.getLogger(__name__)


class WriterPort(Protocol):
    """What the writer needs from the prefill transfer."""

    transport: Transport
    layout: KVLayout  # this prefill rank's pool

    def decode_target(self, endpoint: str) -> tuple[dict, KVLayout]:
        """(the transport descriptor of the decode at side-channel ``endpoint``, its pool layout)."""
        ...

    def report(self, endpoint: str, room: int, status: KVPoll, reason: str | None, **aux) -> None:
        """Send the room's ``Status`` to the decode rank at ``endpoint``."""
        ...


class PageWriter:
    """The transfer thread (``pd-prefill-transfer``). ``put(sender)`` queues a room; ``close`` stops it."""

    def __init__(self, port: WriterPort) -> None:
        self._port = port
        self._queue: queue.Queue[KVSender | None] = queue.Queue()
        self._hold = TestDelay("prefill_write")
        self._thread = threading.Thread(target=self._loop, name="pd-prefill-transfer", daemon=True)
        self._thread.start()

    def put(self, sender: KVSender) -> None:
        self._queue.put(sender)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            sender = self._queue.get()
            if sender is None:
                return
            if hold := self._hold(sender.bootstrap_room):  # test-only (``TestDelay``)
                time.sleep(hold)
            with sender.write_lock:
                self._run_jobs(sender)

    def _run_jobs(self, sender: KVSender) -> None:
        with sender.lock:
            sender.queued = False
            if sender.state == KVPoll.Failed:
                return
            jobs, sender.jobs = sender.jobs, []
            dests = list(sender.dests)
            sender.writing = True
        error = None
        try:
            for dest in dests:
                self._write(sender.bootstrap_room, dest, jobs)
        except TransferFailed as exc:
            error = str(exc)
        except Exception as exc:  # a transport bug fails this room; the thread must live on for the others
            logger.exception("bootstrap room %d: unexpected error in the KV transfer", sender.bootstrap_room)
            error = f"unexpected error in the KV transfer: {type(exc).__name__}: {exc}"
        status, aux = None, {}
        with sender.lock:
            sender.writing = False
            if sender.state == KVPoll.Failed:
                if sender.notify_pending:
                    status = KVPoll.Failed
            elif error is not None:
                sender.move(KVPoll.Failed, error)
                status = KVPoll.Failed
            else:
                sender.written += sum(len(src) for src, _ in jobs)
                if sender.written == sender.num_pages and sender.first_token_id is not None:
                    sender.move(KVPoll.Success)
                    status = KVPoll.Success
                    aux = {"first_token_id": sender.first_token_id, "meta": sender.meta}
            reason = sender.reason
        if error is not None:
            logger.warning("bootstrap room %d failed: %s", sender.bootstrap_room, error)
        if status is not None:
            for dest in dests:
                self._port.report(dest["endpoint"], sender.bootstrap_room, status, reason, **aux)

    def _write(self, room: int, dest: dict, jobs: list[tuple[torch.Tensor, int]]) -> None:
        """Write the queued pages to one decode rank: whole pages (equal tp, or a ``whole`` share such as an
        MLA latent), or its share of the heads (nothing for an empty share). Raises ``TransferFailed``."""
        share = dest["share"]
        if share is not None and share["n"] == 0:
            return
        target, layout = self._port.decode_target(dest["endpoint"])
        if share is not None and share.get("whole"):
            why = whole_share_mismatch(self._port.layout, layout, share)
            if why is not None:
                raise TransferFailed(why)
            share = None  # every head of both pools (MLA's latent): whole pages, one entry per run
        for src, offset in jobs:
            chunk_dst = dest["pages"][offset : offset + len(src)]
            chunk_share = None if share is None else {**share, "page_offset": offset}
            self._port.transport.write(target, layout, src, chunk_dst, room, chunk_share)
