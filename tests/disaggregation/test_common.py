"""``common.py``: bootstrap address and room checks, and the test-only ``TestDelay``."""

from __future__ import annotations

import pytest

from engine.disaggregation.common import TEST_DELAY_ENV, TestDelay, bootstrap_address, check_room


def test_test_delay_holds_the_rooms_after_the_first_skip(monkeypatch):
    monkeypatch.setenv(TEST_DELAY_ENV, "prefill_send=2.5:1, decode_info=7")
    send, info, write = TestDelay("prefill_send"), TestDelay("decode_info"), TestDelay("prefill_write")
    assert send(10) == 0.0 and send(10) == 0.0  # the first room goes through, every time it is asked
    assert send(11) == 2.5 and send(12) == 2.5
    assert info(10) == 7.0
    assert write(10) == 0.0  # not named: no hold


def test_test_delay_is_off_without_the_env_var(monkeypatch):
    monkeypatch.delenv(TEST_DELAY_ENV, raising=False)
    assert TestDelay("prefill_write")(1) == 0.0


def test_bootstrap_address_and_room_are_checked():
    assert bootstrap_address("::1", 8998) == "[::1]:8998"
    assert bootstrap_address("127.0.0.1", 8998) == "127.0.0.1:8998"
    with pytest.raises(ValueError, match="bootstrap_port must be an integer in \\[1, 65535\\], got 0"):
        bootstrap_address("127.0.0.1", 0)
    with pytest.raises(ValueError, match="bootstrap_room must be an integer"):
        check_room(True)
    assert check_room(2**63 - 1) == 2**63 - 1
