"""The rebalance benchmark's fleet for the restart method: the control plane's API under daphne (the agent
talks to it) and one `kvfleet-agent run` that launches and supervises the three engines (started without
--enable-pd-role-switch, so each step's agent restarts its worker in the new role).

The agent's token goes to it by environment (KVFLEET_AGENT_TOKEN), never on a command line. Runs in the
benchmark's process after django.setup(), on its database.
"""

import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
HOST = "bench-agent-host"
ENGINE_KEYS = (
    'model = "smollm2"\npage_size = 16\nrandom_seed = 0\nenable_metrics = true\nmax_total_tokens = 2048\n'
)


def _wait(check, what: str, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out ({limit_s:g} s) waiting for {what}")
        time.sleep(0.3)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_control_plane(env: dict, procs: list) -> str:
    """daphne serving controlplane.asgi on a free loopback port (appended to `procs`); its base URL."""
    from engine.ports import free_port

    port = free_port()
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "controlplane.asgi:application"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    ))  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    _wait(lambda: _answers(f"{base}/healthz"), "the control plane to answer /healthz", 90)
    return base


def _spec(folder: Path, roles: dict[str, str]) -> tuple[Path, dict[str, str]]:
    from engine.ports import free_port

    text = f'[agent]\nhost_name = "{HOST}"\nlog_dir = "{folder}"\nheartbeat_interval_s = 1\n'
    text += "metrics_interval_s = 3600\nhealth_interval_s = 1\n"
    urls = {}
    for name, role in roles.items():
        port = free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        text += f'\n[[workers]]\nname = "{name}"\n{ENGINE_KEYS}disaggregation_mode = "{role}"\n'
        text += f"disaggregation_bootstrap_port = {free_port()}\nport = {port}\n"
    path = folder / "fleet.toml"
    path.write_text(text)
    return path, urls


def start_agent(control_plane: str, env: dict, roles: dict[str, str], procs: list) -> dict[str, str]:
    """A real agent running one engine per `roles` entry (name -> prefill | decode), appended to `procs`;
    returns name -> URL once it registered all of them and each answers /health (engine start: minutes on
    a loaded machine)."""
    import tempfile

    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group

    from controlplane.accounts.services import token_create
    from controlplane.inventory.models import EngineWorker

    user = get_user_model().objects.create_user(username=f"bench-agent-{secrets.token_hex(4)}")
    user.groups.add(Group.objects.get(name="agent"))
    _, token = token_create(user=user, name="rebalance bench agent", actor=None, host=HOST)
    path, urls = _spec(Path(tempfile.mkdtemp(prefix="rb-bench-agent-")), roles)
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "engine.agent", "run", "--control-plane", control_plane, "--spec", str(path)],
        cwd=REPO, env={**env, "KVFLEET_AGENT_TOKEN": token}, stdout=subprocess.DEVNULL,
        stderr=(path.parent / "agent.log").open("wb"),
    ))  # fmt: skip

    def ready() -> bool:
        registered = EngineWorker.objects.filter(host__name=HOST, state="online").count() == len(urls)
        return registered and all(_answers(f"{url}/health") for url in urls.values())

    _wait(ready, f"the agent to start and register {len(urls)} engines (log: {path.parent})", 900)
    return urls


def stop(procs: list) -> None:
    """SIGTERM each process (the agent stops its engines), newest first; SIGKILL after 60 s."""
    for proc in reversed(procs):
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
