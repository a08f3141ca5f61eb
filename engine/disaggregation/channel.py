"""The ZMQ side channel between a prefill and a decode transfer (upstream's mooncake/conn.py;
docs/upstream.md P3).

Each manager binds one PULL socket (its endpoint ``tcp://host:port`` is what the peer connects to) and owns
PUSH sockets towards its peers. A message is a JSON header frame plus optional raw payload frames.
One daemon thread receives: it calls ``on_message(header, payloads)`` and, between messages (at least
every ``tick_s``), ``on_tick()``. ``send`` only hands the frames to ZMQ's own I/O thread (a PUSH socket
connects asynchronously and queues up to its high-water mark), so callers never wait on the network;
a lock serialises the sockets, which are not thread-safe.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import zmq

logger = logging.getLogger(__name__)
SEND_TIMEOUT_MS = 30_000  # upstream's PUSH send timeout


class Channel:
    """Bind a PULL socket on ``host`` (a free port) and start the receive and send threads."""

    def __init__(self, host: str, on_message, on_tick, tick_s: float = 0.2, name: str = "pd") -> None:
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"{host}:{port}"
        self._on_message = on_message
        self._on_tick = on_tick
        self._tick_ms = int(tick_s * 1000)
        self._push: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._recv_loop, name=f"{name}-recv", daemon=True)
        self._thread.start()

    def send(self, endpoint: str, header: dict, payloads: list | None = None) -> None:
        """Send ``header`` (+ raw bytes-like ``payloads``) to the peer bound at ``endpoint`` (host:port).

        Messages to one endpoint arrive in the order sent. A failed send is logged (the peer's timeouts
        and the heartbeat turn a lost message into a failed room)."""
        frames = [json.dumps(header).encode(), *(payloads or [])]
        with self._send_lock:
            if self._stop.is_set():
                return
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
                sock.connect(f"tcp://{endpoint}")
                self._push[endpoint] = sock
            try:
                sock.send_multipart(frames, copy=False)
            except zmq.ZMQError as exc:
                logger.warning("PD side channel: send to %s failed: %s", endpoint, exc)

    def forget(self, endpoint: str) -> None:
        """Close the PUSH socket towards ``endpoint`` (a peer that went away): messages still queued for it
        are dropped, and a later ``send`` there connects afresh."""
        with self._send_lock:
            sock = self._push.pop(endpoint, None)
            if sock is not None:
                sock.close(0)

    def has_socket(self, endpoint: str) -> bool:
        """Whether a PUSH socket towards ``endpoint`` is open (until ``forget`` or ``close``)."""
        with self._send_lock:
            return endpoint in self._push

    def close(self) -> None:
        if self._stop.is_set():
            return
        with self._send_lock:
            self._stop.set()
            for sock in self._push.values():
                sock.close(0)
        self._thread.join(timeout=10)
        self._pull.close(0)
        self._ctx.term()

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        last_tick = time.monotonic()
        while not self._stop.is_set():
            if poller.poll(self._tick_ms):
                frames = self._pull.recv_multipart(copy=False)
                try:
                    self._on_message(json.loads(frames[0].bytes), [f.buffer for f in frames[1:]])
                except Exception:  # noqa: BLE001 - a bad message must not kill the channel
                    logger.exception("PD side channel: failed to handle a message")
            if time.monotonic() - last_tick >= self._tick_ms / 1000:
                last_tick = time.monotonic()
                try:
                    self._on_tick()
                except Exception:  # noqa: BLE001
                    logger.exception("PD side channel: periodic check failed")
