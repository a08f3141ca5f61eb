"""The scheduler's inbox: the one way other threads hand it work.

Any thread puts a request, an ``AbortReq`` or a :class:`Command` (an admin message, or for tests and tools a
function of the scheduler, with the future it answers); the scheduler thread takes them in order. Closing
is done once, when the loop ends: from then on every ``put`` is refused, and ``close`` returns what was
still waiting, so nothing put is ever stranded.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.scheduler.messages import AdminMsg


@dataclass
class Command:
    """An admin message (or, from ``Scheduler.call``, a function of the scheduler) and the future it
    answers."""

    work: AdminMsg | Callable
    future: concurrent.futures.Future


class Inbox:
    """FIFO of work for the scheduler thread. ``closed``: why the loop ended (None while it runs)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders "put into the inbox" against "the loop has ended"
        self.closed: str | None = None

    def put(self, item: object) -> bool:
        """Put ``item`` unless the inbox is closed (then False). Any thread."""
        with self._lock:
            if self.closed is not None:
                return False
            self._queue.put(item)
            return True

    def wake(self) -> None:
        """Wake a waiting ``get`` (it returns None), even after ``close``."""
        self._queue.put(None)

    def get(self, timeout: float | None) -> object:
        """The next item, waiting up to ``timeout`` seconds (None or 0: not at all); raises
        ``queue.Empty`` when there is none. None is a ``wake``."""
        return self._queue.get(timeout=timeout) if timeout else self._queue.get_nowait()

    def close(self, message: str) -> list:
        """Refuse every later ``put`` with reason ``message``; returns the items still waiting."""
        with self._lock:
            self.closed = message
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items
