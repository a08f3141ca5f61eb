"""The end-to-end fleet: deploy/localfleet.py (what `make demo` runs), started once per module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from localfleet import LocalFleet

    log_dir = tmp_path_factory.mktemp("fleet-logs")
    with LocalFleet(log_dir=log_dir, label="e2e") as running:
        yield running
