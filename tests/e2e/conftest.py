"""The end-to-end fleet: deploy/localfleet.py (what `make demo` runs), started once per module."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy"))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """The fleet with a Redis of its own (nothing answers at the free port it is given, so LocalFleet
    starts one), which a test may SIGKILL without touching the suite's shared Redis."""
    from localfleet import LocalFleet

    from engine.ports import free_port

    log_dir = tmp_path_factory.mktemp("fleet-logs")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
        with LocalFleet(log_dir=log_dir, label="e2e") as running:
            yield running
