"""Kernel tests run through Triton's interpreter (``TRITON_INTERPRET=1``, set per test, read at launch)."""

import pytest


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
