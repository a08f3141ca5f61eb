"""A second demo started beside a running one says so (both fleets share two cores) and still starts; the
lock goes with the first demo's process, however it ends."""

from __future__ import annotations

import subprocess
import sys

from localfleet import REPO

CLAIM = (
    "import pathlib, sys; sys.path.insert(0, 'deploy'); import localfleet as m\n"
    "m._DEMO_LOCK = pathlib.Path(sys.argv[1])\n"
    "print(m._claim_demo(pathlib.Path(sys.argv[2])), flush=True)\n"
    "sys.stdin.read()\n"
)


def _claim(lock, log_dir: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CLAIM, str(lock), log_dir],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_second_demo_is_told_where_the_first_one_logs_until_the_first_is_gone(tmp_path):
    lock = tmp_path / "demo.lock"
    first = _claim(lock, "/logs/demo-first")
    assert first.stdout.readline().strip() == "None"  # nobody else: it holds the lock
    second = _claim(lock, "/logs/demo-second")
    assert second.stdout.readline().strip() == "/logs/demo-first"
    second.communicate(timeout=60)
    first.kill()  # however it ends (here SIGKILL), its lock goes with it
    first.wait(timeout=60)
    third = _claim(lock, "/logs/demo-third")
    assert third.stdout.readline().strip() == "None"
    third.communicate(timeout=60)
