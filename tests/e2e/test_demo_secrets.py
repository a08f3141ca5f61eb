"""The demo's secrets stay out of its logs: bootstrap hands the tokens over in a 0600 file, the admin password
in the environment; the log folder is 0700 and its files 0600 (real migrate + manage.py bootstrap, SQLite)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from localfleet import REPO, LocalFleet

from controlplane.accounts.management.commands.bootstrap import write_secret_file


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_bootstrap_tokens_and_password_never_reach_the_log(tmp_path):
    fleet = LocalFleet(log_dir=tmp_path / "demo-secrets")
    fleet.log_dir.mkdir(mode=0o755)
    fleet.make_log_dir()
    assert _mode(fleet.log_dir) == 0o700
    fleet.env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(REPO),
        "DATABASE_URL": f"sqlite:///{fleet.log_dir / 'controlplane.sqlite3'}",
        "SECRET_KEY": "k" * 50,
        "DEBUG": "0",
        "DEMO_HOST_NAME": "secrets-host",
    }
    fleet._run("manage.py", "migrate", "--noinput")
    fleet._bootstrap()
    admin, agent, prometheus = fleet.tokens["admin"], fleet.tokens["agent"], fleet.tokens["prometheus"]
    assert admin.startswith("cp_") and agent.startswith("cp_") and prometheus.startswith("cp_")
    log = fleet.log_of("manage")
    text = Path(log).read_text()
    assert "manage.py bootstrap" in text and "ready" in text
    for secret in (admin, agent, prometheus, fleet.admin_password):
        assert secret not in text
    assert _mode(log) == 0o600
    assert not fleet.secrets_dir.exists()  # the tokens file was read and removed


def test_secret_file_is_owner_only_even_when_it_existed(tmp_path):
    path = tmp_path / "new" / "tokens.json"
    write_secret_file(str(path), "a")
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    path.chmod(0o644)
    write_secret_file(str(path), "b")
    assert _mode(path) == 0o600 and path.read_text() == "b"
