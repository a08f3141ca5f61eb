"""Settings refuse to start without SECRET_KEY unless DEBUG is on (a public default key must never serve)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SHOW_KEY = "import controlplane.settings as s; print(s.DEBUG, s.SECRET_KEY)"


def _settings(**env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG")}
    return subprocess.run(
        [sys.executable, "-c", SHOW_KEY],
        cwd=REPO,
        env={**clean, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("debug", [None, "0", "false"])
def test_missing_secret_key_with_debug_off_is_a_startup_error(debug):
    done = _settings(**({} if debug is None else {"DEBUG": debug}))
    assert done.returncode != 0
    assert "django.core.exceptions.ImproperlyConfigured: SECRET_KEY is not set" in done.stderr


def test_secret_key_from_the_environment_and_dev_default_only_with_debug():
    assert _settings(SECRET_KEY="k" * 50).stdout.split() == ["False", "k" * 50]
    debug = _settings(DEBUG="1")
    assert debug.returncode == 0 and debug.stdout.split() == [
        "True",
        "dev-only-insecure-key-set-SECRET_KEY-in-production",
    ]


def test_postgresql_gets_a_bounded_pool_sized_by_the_environment():
    show = "from controlplane.settings import DATABASES\nd = DATABASES['default']\n"
    show += "print(d['CONN_MAX_AGE'], d['OPTIONS'])"
    env = {"SECRET_KEY": "k" * 50, "DATABASE_URL": "postgres://u@db:5432/kv", "DB_POOL_MAX_SIZE": "7"}
    clean = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DB_POOL_MIN_SIZE")}
    env = {**clean, "PYTHONPATH": str(REPO), **env}
    done = subprocess.run([sys.executable, "-c", show], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "0 {'pool': {'min_size': 1, 'max_size': 7, 'timeout': 10.0, 'max_idle': 300}}"
    )
