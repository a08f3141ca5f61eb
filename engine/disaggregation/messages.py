"""The side-channel messages between a prefill (P) and a decode (D), as typed records, and their dispatch.

Each message is a frozen dataclass; on the wire it is its fields as a JSON object plus ``"type"`` (the
names upstream's mooncake/conn.py side channel uses where it has one). ``endpoint`` is always the
sender's side-channel endpoint (``host:port``): the receiver answers there and knows the peer by it.

| type | from | meaning |
|---|---|---|
| ``register`` | D | D's pool layout and transport descriptor (first contact, once per prefill rank) |
| ``claim`` | D | D opened ``room`` towards this prefill (before its pages are reserved) |
| ``transfer`` | D | D's destination pages for ``room`` (and, across tp sizes, its share of heads) |
| ``transfer_ack`` | P | P got that transfer info; ``start_id`` is P's bootstrap instance |
| ``status`` | P | ``room`` ended Success (with the first token and metadata) or Failed (``reason``) |
| ``abort`` / ``abort_ack`` | both | stop ``room``; the ack: no write to its pages is in flight any more |
| ``ping`` / ``pong`` | P / D | P's liveness probe of a decode it has met; D's ``start_id`` is its instance |

``Dispatch`` maps each message class to a handler; ``kv`` (the ``fake`` transport's payload frames) and any
other raw type go to a raw handler with the frames.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Message:
    type: ClassVar[str] = "?"
    endpoint: str  # the sender's side-channel endpoint

    def to_wire(self) -> dict:
        """The JSON header: the fields plus ``type``."""
        return {"type": self.type, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Register(Message):
    type: ClassVar[str] = "register"
    layout: dict  # ``KVLayout.to_wire()``
    transport: dict  # the transport's ``descriptor()``
    start_id: str | None = None  # this decode's instance (new per DecodeTransfer)


@dataclass(frozen=True)
class Claim(Message):
    type: ClassVar[str] = "claim"
    room: int
    start_id: str | None = None


@dataclass(frozen=True)
class TransferInfo(Message):
    type: ClassVar[str] = "transfer"
    room: int
    pages: list[int]  # D's pages, prompt order
    share: dict | None = None  # across tp sizes: {"src_head", "dst_head", "n", optional "staging"}
    required: int | None = None  # how many decode ranks that prefill rank sends the room to (None: 1)


@dataclass(frozen=True)
class TransferAck(Message):
    type: ClassVar[str] = "transfer_ack"
    room: int
    start_id: str


@dataclass(frozen=True)
class Status(Message):
    type: ClassVar[str] = "status"
    room: int
    status: int  # ``KVPoll.Success`` or ``KVPoll.Failed``
    reason: str | None = None
    first_token_id: int | None = None
    meta: dict | None = None


@dataclass(frozen=True)
class Abort(Message):
    type: ClassVar[str] = "abort"
    room: int
    reason: str | None = None
    refused: bool = False  # D refused the request (the client's answer is a 400)
    by: str | None = None  # who aborts (``prefill`` for one prefill aborting at another), default decode


@dataclass(frozen=True)
class AbortAck(Message):
    type: ClassVar[str] = "abort_ack"
    room: int


@dataclass(frozen=True)
class Ping(Message):
    type: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Pong(Message):
    type: ClassVar[str] = "pong"
    start_id: str | None = None


MESSAGES: dict[str, type[Message]] = {
    m.type: m for m in (Register, Claim, TransferInfo, TransferAck, Status, Abort, AbortAck, Ping, Pong)
}


def from_wire(header: dict) -> Message:
    """The message a JSON header carries. Raises ``ValueError`` on an unknown type or missing field
    (unknown extra fields are ignored, so a newer peer's additions do not break an older one)."""
    cls = MESSAGES.get(header.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown side-channel message type {header.get('type')!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in header.items() if k in names})
    except TypeError as exc:
        raise ValueError(f"bad {cls.type} message: {exc}") from None


@dataclass
class Dispatch:
    """Calls the handler of each message's class (on the channel's receive thread). ``raw``: handlers of
    types that are not ``Message`` classes, called with the header and the payload frames. A message
    without a handler is logged and dropped."""

    handlers: dict[type[Message], Callable[[Any], None]]
    raw: dict[str, Callable[[dict, list], None]] = field(default_factory=dict)
    heard: Callable[[Message], object] | None = None  # called first with every decoded message

    def __call__(self, header: dict, payloads: list) -> None:
        raw = self.raw.get(header.get("type"))  # type: ignore[arg-type]
        if raw is not None:
            raw(header, payloads)
            return
        try:
            msg = from_wire(header)
        except ValueError as exc:
            logger.warning("PD side channel: %s", exc)
            return
        if self.heard is not None:
            self.heard(msg)
        handler = self.handlers.get(type(msg))
        if handler is None:
            logger.warning("PD side channel: no handler for %r here", msg.type)
            return
        handler(msg)
