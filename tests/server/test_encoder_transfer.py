"""The EPD mooncake embedding transfer's parts over a real Mooncake TransferEngine (TCP on loopback): the
encoder's sender writes through its staging slot into the worker's registered receive slot, and the slot
pools hand out, hold back and return slots."""

from __future__ import annotations

import time

import pytest
import torch

from engine.server.encoder_transfer import EmbeddingReceiver, EmbeddingSender


@pytest.fixture(scope="module")
def pair():
    receiver = EmbeddingReceiver("127.0.0.1", slot_bytes=64 * 1024, slots=2)
    sender = EmbeddingSender("127.0.0.1", slot_bytes=10_000, slots=1)  # smaller: the write goes in chunks
    yield receiver, sender
    sender.close()
    receiver.close()


def test_embeddings_larger_than_the_staging_slot_arrive_whole_and_every_slot_comes_back(pair):
    receiver, sender = pair
    embeds = torch.randn(2, 9, 400)  # 28,800 bytes: three chunks of the sender's 10,000-byte slot
    slot = receiver.pool.acquire(timeout_s=1)
    sender.send(embeds, receiver.session_id, receiver.pool.addr(slot))
    assert torch.equal(receiver.read(slot, [2, 9, 400]), embeds)
    receiver.pool.release(slot)
    assert receiver.pool.stats() == {"slots": 2, "free": 2, "held_back": 0, "slot_bytes": 64 * 1024}
    assert sender.pool.stats()["free"] == 1


def test_a_shape_larger_than_the_slot_is_refused(pair):
    receiver, _ = pair
    slot = receiver.pool.acquire(timeout_s=1)
    try:
        with pytest.raises(ValueError, match="do not fit"):
            receiver.read(slot, [1, 64, 1024])
    finally:
        receiver.pool.release(slot)


def test_no_free_slot_times_out_saying_so_and_a_held_back_slot_returns_at_its_time(pair):
    receiver, _ = pair
    slots = [receiver.pool.acquire(timeout_s=1) for _ in range(2)]
    with pytest.raises(TimeoutError, match="all 2 embedding transfer buffers busy"):
        receiver.pool.acquire(timeout_s=0.05)
    back_at = time.time() + 0.3
    receiver.pool.release_at(slots[0], back_at)
    assert receiver.pool.stats()["held_back"] == 1
    again = receiver.pool.acquire(timeout_s=5)  # blocks until the timer returns the slot
    assert time.time() >= back_at and again == slots[0]
    assert receiver.pool.stats()["held_back"] == 0
    for slot in (again, slots[1]):
        receiver.pool.release(slot)
    assert receiver.pool.stats()["free"] == 2
