"""The demo's console serves the JS/CSS collected into its own folder at start-up, never the checkout's
sources: WhiteNoise records each file's size when the server starts and reads it at each request, so a
source edited or pulled under a running demo was served cut to its old size (a script that does not parse:
every page stopped loading). Real collectstatic and WhiteNoise's file index, in a child process with the
fleet's environment."""

from __future__ import annotations

import subprocess
import sys

from localfleet import REPO, LocalFleet

INDEX = (
    "import django; django.setup()\n"
    "from whitenoise.middleware import WhiteNoiseMiddleware\n"
    "files = WhiteNoiseMiddleware(lambda request: None).files\n"
    "print(files['/static/frontend/js/core.js'].alternatives[-1][1])\n"
)


def _served_path(env: dict) -> str:
    done = subprocess.run(
        [sys.executable, "-c", INDEX], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_demo_serves_its_collected_copy_not_the_sources(tmp_path):
    fleet = LocalFleet(log_dir=tmp_path / "demo")
    fleet.make_log_dir()
    env = {**fleet.base_env(), "SECRET_KEY": "k" * 50, "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    fleet.env = env
    fleet._run("manage.py", "collectstatic", "--noinput")
    collected = fleet.log_dir / "static" / "frontend" / "js" / "core.js"
    assert collected.read_bytes() == (REPO / "frontend/static/frontend/js/core.js").read_bytes()
    assert _served_path(env) == str(collected)
    # what it served before: the source file itself (finders on, the setting's default for development)
    sources = {k: v for k, v in env.items() if k not in ("STATIC_ROOT", "WHITENOISE_USE_FINDERS")}
    assert _served_path(sources) == str(REPO / "frontend/static/frontend/js/core.js")
