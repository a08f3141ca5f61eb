"""CLI without a control plane: `status` of workers that are not running; usage errors name the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.agent.cli import format_table, main, status_rows
from engine.agent.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


def _spec(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(
        f'[agent]\nlog_dir = "{tmp_path}"\n\n[[workers]]\nname = "w0"\nmodel = "smollm2"\nport = 9\n'
    )
    return path


def test_status_of_a_worker_that_is_not_running(tmp_path):
    spec = load_spec(_spec(tmp_path))
    (row,) = status_rows(spec)
    assert row["worker"] == "w0" and row["state"] == "down" and row["idle"] is None and row["device"] is None
    lines = format_table([row]).splitlines()
    assert lines[0].split() == [
        "WORKER",
        "URL",
        "STATE",
        "PID",
        "RESTARTS",
        "IDLE",
        "RUNNING",
        "WAITING",
        "L3",
        "HIT_DEVICE",
        "HIT_HOST",
        "HIT_STORAGE",
    ]
    assert lines[1].split() == [
        "w0",
        "http://127.0.0.1:9",
        "down",
        "-",
        "0",
        "-",
        "-",
        "-",
        "-",
        "-",
        "-",
        "-",
    ]


def test_status_reads_the_supervisor_state_file(tmp_path):
    spec = load_spec(_spec(tmp_path))
    state = {
        "workers": [
            {"name": "w0", "state": "backoff", "pid": None, "restarts": 3, "local_url": "http://127.0.0.1:9"}
        ]
    }
    Path(spec.state_file).write_text(json.dumps(state))
    (row,) = status_rows(spec)
    assert (row["state"], row["restarts"]) == ("backoff", 3)


def test_run_without_token_names_the_flag(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.agent",
            "run",
            "--control-plane",
            "http://127.0.0.1:9",
            "--spec",
            str(_spec(tmp_path)),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2
    assert "--token or --token-file is required" in done.stderr


@pytest.mark.parametrize(
    "argv, flag",
    [(["--bogus"], "--bogus"), (["run", "--bogus-flag"], "--bogus-flag"), (["drain", "--nope"], "--nope")],
)
def test_an_unknown_flag_is_named_before_missing_required_ones(argv, flag):
    done = subprocess.run(
        [sys.executable, "-m", "engine.agent", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"kvfleet-agent: error: unrecognized arguments: {flag}"


def test_a_missing_required_flag_is_still_reported(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run"])
    assert exc.value.code == 2
    assert "the following arguments are required: --spec" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "status"])
def test_help_shows_the_required_spec_as_required(command, capsys):
    """The first, lenient parse (unknown flags before missing ones) must not turn ``--spec`` optional in
    ``--help``'s usage line."""
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    usage = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    assert " --spec SPEC " in f"{usage} " and "[--spec SPEC]" not in usage
