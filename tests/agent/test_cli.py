"""CLI: `status` of workers that are not running; usage errors name the flag or command and the closest
real one; a drain that times out says how to undo it and `undrain` does (against a real HTTP stand-in of the
control plane and a busy worker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
        "agent_pid": os.getpid(),  # a running agent's
        "workers": [
            {"name": "w0", "state": "backoff", "pid": None, "restarts": 3, "local_url": "http://127.0.0.1:9"}
        ],
    }
    Path(spec.state_file).write_text(json.dumps(state))
    (row,) = status_rows(spec)
    assert (row["state"], row["restarts"]) == ("backoff", 3)


def test_status_from_the_state_file_alone_names_the_workers_the_agent_resolved(tmp_path, capsys):
    """The state file holds each worker's name and URLs as the running agent resolved them: no spec and no
    environment needed. The agent's pid is checked: a state left by a stopped agent says so."""
    state = {"agent_pid": os.getpid(), "workers": [
        {"name": "demo-7-w0", "url": "http://10.0.0.5:9", "local_url": "http://127.0.0.1:9",
         "state": "running", "pid": 4242, "restarts": 1},
    ]}  # fmt: skip
    path = tmp_path / "agent-state.json"
    path.write_text(json.dumps(state))
    assert main(["status", "--state-file", str(path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["worker"], row["url"], row["state"], row["pid"], row["restarts"]) == (
        "demo-7-w0", "http://10.0.0.5:9", "running", 4242, 1
    )  # fmt: skip
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    path.write_text(json.dumps({**state, "agent_pid": int(dead.stdout)}))
    (row,) = status_rows(state=json.loads(path.read_text()))
    assert (row["state"], row["pid"]) == ("down", None)  # the agent is gone and nothing answers on :9


def test_status_without_a_state_file_there_names_the_flag(tmp_path, capsys):
    assert main(["status", "--state-file", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err
    assert "--state-file" in err and "agent-state.json" in err


def test_status_needs_the_state_file_or_the_spec(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["status"])
    assert exc.value.code == 2
    assert "one of the arguments --state-file --spec is required" in capsys.readouterr().err


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
    "argv, prog, flag",
    [
        (["--bogus"], "kvfleet-agent", "--bogus"),
        (["run", "--bogus-flag"], "kvfleet-agent run", "--bogus-flag"),
        (["drain", "--nope"], "kvfleet-agent drain", "--nope"),
    ],
)
def test_an_unknown_flag_is_named_before_missing_required_ones(argv, prog, flag):
    """Under the usage of the command it was given to (argparse's own wording)."""
    done = subprocess.run(
        [sys.executable, "-m", "engine.agent", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"{prog}: error: unrecognized arguments: {flag}"
    assert done.stderr.startswith(f"usage: {prog} ")


@pytest.mark.parametrize(
    ("typo", "closest"),
    [("--spek", "--spec"), ("--controlplane", "--control-plane"), ("--log-levl", "--log-level")],
)
def test_an_unknown_run_flag_names_run_and_its_closest_flag_and_starts_nothing(
    typo, closest, tmp_path, monkeypatch, capsys
):
    """The hint is the engine CLI's (engine.unknown_flags), after the flag's value; no agent is made. The
    same command line without the typo makes one (the spec, the control plane and the token are valid)."""
    import engine.agent.agent

    made = []

    class Agent:
        def __init__(self, spec, client):
            made.append(spec)

        def run(self) -> int:
            return 0

    monkeypatch.setattr(engine.agent.agent, "Agent", Agent)
    argv = ["run", "--spec", str(_spec(tmp_path)), "--control-plane", "http://127.0.0.1:9", "--token", "t"]
    with pytest.raises(SystemExit) as exc:
        main([*argv, typo, "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvfleet-agent run ")
    last = err.strip().splitlines()[-1]
    assert last == f"kvfleet-agent run: error: unrecognized arguments: {typo} x (did you mean {closest}?)"
    assert made == []
    assert main(argv) == 0 and len(made) == 1


def test_an_unknown_flag_is_matched_against_its_own_command_only(capsys):
    """``--timeout`` is drain's: a typo of it given to ``run`` gets no hint to it."""
    with pytest.raises(SystemExit):
        main(["run", "--spec", "fleet.toml", "--timout", "3"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "kvfleet-agent run: error: unrecognized arguments: --timout 3"
    )
    with pytest.raises(SystemExit):
        main(["drain", "w0", "--timout", "3"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "kvfleet-agent drain: error: unrecognized arguments: --timout 3 (did you mean --timeout?)"
    )


def test_a_missing_required_flag_is_still_reported(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["run"])
    assert exc.value.code == 2
    assert "the following arguments are required: --spec" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run"])
def test_help_shows_the_required_spec_as_required(command, capsys):
    """The first, lenient parse (unknown flags before missing ones) must not turn ``--spec`` optional in
    ``--help``'s usage line."""
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    usage = " ".join(capsys.readouterr().out.split("\n\n")[0].split())
    assert " --spec SPEC " in f"{usage} " and "[--spec SPEC]" not in usage


@pytest.mark.parametrize(
    ("command", "closest"), [("stats", "status"), ("drian", "drain"), ("undran", "undrain")]
)
def test_an_unknown_command_names_the_closest_one(command, closest, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "w0"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"kvfleet-agent: error: unknown command {command!r}; did you mean {closest!r}?"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--contorl-plane", "http://x", "run"],
            "--contorl-plane: flags go after the command: kvfleet-agent run --control-plane ...",
        ),
        (["--spec=a.toml", "status"], "--spec: flags go after the command: kvfleet-agent status --spec ..."),
        (
            ["--token", "t"],
            "--token: flags go after the command (run, status, drain, undrain, check-isolation)",
        ),
    ],
)
def test_a_flag_before_the_command_is_named_with_where_it_goes(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"kvfleet-agent: error: {said}"


def test_version_prints_the_agent_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == "kvfleet-agent 0.1.0"


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_drain_refuses_a_timeout_that_is_not_positive(value, capsys):
    # refused before any call: the control plane URL has nothing listening
    with pytest.raises(SystemExit) as exc:
        main(["drain", "w0", f"--timeout={value}", "--control-plane", "http://127.0.0.1:9", "--token", "t"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --timeout: must be a number of seconds > 0" in err


class _ControlPlane(BaseHTTPRequestHandler):
    """The control plane's worker list, drain and undrain for worker 7 ("w0", at this server's /w0), and
    the worker's /server_info: always busy."""

    posts: list[str] = []

    def _json(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        if self.path.startswith("/api/v1/inventory/workers/"):
            url = f"http://127.0.0.1:{self.server.server_port}/w0"
            return self._json({"results": [{"id": 7, "name": "w0", "url": url}]})
        return self._json({"is_idle": False, "num_running_reqs": 2, "num_waiting_reqs": 1})

    def do_POST(self):  # noqa: N802
        self.posts.append(self.path)
        if self.path.endswith("/undrain/"):
            return self._json({"worker": 7, "router": "http://router", "added": True})
        return self._json({"worker": 7, "router": "http://router", "removed": True})

    def log_message(self, *args):
        pass


@pytest.fixture
def control_plane():
    _ControlPlane.posts = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ControlPlane)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", _ControlPlane.posts
    server.shutdown()
    server.server_close()


def test_a_drain_that_times_out_says_how_to_undo_it_and_undrain_does(control_plane, capsys):
    url, posts = control_plane
    flags = ["--control-plane", url, "--token", "t"]
    assert main(["drain", "w0", "--timeout", "0.1", *flags]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "kvfleet-agent drain: error: w0 not idle after 0.1s (2 running, 1 waiting); it stays out of router "
        "http://router: put it back with `kvfleet-agent undrain w0`"
    )
    assert main(["undrain", "w0", *flags]) == 0
    assert capsys.readouterr().out.strip() == "w0: added to router http://router"
    assert posts == ["/api/v1/inventory/workers/7/drain/", "/api/v1/inventory/workers/7/undrain/"]
