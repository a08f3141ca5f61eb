"""The typed side-channel messages: wire round trip, bad headers, dispatch by class."""

from __future__ import annotations

import logging

import pytest

from engine.disaggregation.messages import (
    MESSAGES,
    Abort,
    Claim,
    Dispatch,
    Ping,
    Status,
    TransferInfo,
    from_wire,
)


def test_every_message_round_trips_through_its_wire_header():
    samples = [
        Claim("d:1", 5, "abc"),
        TransferInfo("d:1", 5, [1, 2, 3], {"src_head": 0, "dst_head": 0, "n": 1}, 2),
        Status("p:1", 5, 4, None, 17, {"cached_tokens": 3}),
        Abort("d:1", 5, "waiting timeout", refused=True),
        Ping("p:1"),
    ]
    for msg in samples:
        header = msg.to_wire()
        assert header["type"] == msg.type and MESSAGES[msg.type] is type(msg)
        assert from_wire(header) == msg


def test_a_bad_header_is_a_clear_error_and_extra_fields_are_ignored():
    with pytest.raises(ValueError, match="unknown side-channel message type 'nope'"):
        from_wire({"type": "nope", "endpoint": "x"})
    with pytest.raises(ValueError, match="bad claim message"):
        from_wire({"type": "claim", "endpoint": "x"})  # no room
    assert from_wire({"type": "ping", "endpoint": "x", "future_field": 1}) == Ping("x")


def test_dispatch_calls_the_handler_of_the_class_and_raw_handlers_with_frames(caplog):
    seen, heard = [], []
    dispatch = Dispatch(
        {Claim: seen.append},
        raw={"kv": lambda header, payloads: seen.append((header["room"], payloads))},
        heard=heard.append,
    )
    dispatch(Claim("d:1", 5).to_wire(), [])
    dispatch({"type": "kv", "room": 6}, [b"bytes"])
    with caplog.at_level(logging.WARNING):
        dispatch(Ping("p:1").to_wire(), [])  # no handler here
        dispatch({"type": "bogus"}, [])
    assert seen == [Claim("d:1", 5), (6, [b"bytes"])]
    assert heard == [Claim("d:1", 5), Ping("p:1")]
    assert "no handler for 'ping'" in caplog.text and "unknown side-channel message type" in caplog.text
