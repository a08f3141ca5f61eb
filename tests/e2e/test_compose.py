"""docker-compose.yml cannot run here (no Docker): check it parses and agrees with the real commands — every
service's module/file exists, the engine host's spec loads with the compose environment, the router points
at the worker the spec declares, and every long-running service has a health check."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

from engine.agent.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _env(service: str) -> dict:
    """The service's environment with compose's ``${VAR:-default}`` taken at its default."""
    raw = {k: str(v) for k, v in (SERVICES[service].get("environment") or {}).items()}
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", v) for k, v in raw.items()}


def test_every_long_running_service_has_a_health_check_and_ordered_start():
    one_shot = {name for name, s in SERVICES.items() if s.get("restart") == "no"}
    assert one_shot == {"migrate"}
    unchecked = {name for name in SERVICES if name not in one_shot and "healthcheck" not in SERVICES[name]}
    assert unchecked == {"celery-beat"}  # beat has no probe of its own; its tasks show in the worker's log
    assert SERVICES["engine-host"]["depends_on"]["web"]["condition"] == "service_healthy"
    assert SERVICES["router"]["depends_on"]["engine-host"]["condition"] == "service_healthy"
    assert set(COMPOSE["volumes"]) >= {"pgdata", "l3-files", "redisdata"}


def test_commands_name_real_modules_and_files():
    for name, service in SERVICES.items():
        cmd = service.get("command")
        if isinstance(cmd, list) and cmd[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(cmd[2]) is not None, f"{name}: no module {cmd[2]}"
        if isinstance(cmd, list) and "--spec" in cmd:
            assert (REPO / cmd[cmd.index("--spec") + 1]).is_file(), name
    assert "manage.py bootstrap" in " ".join(SERVICES["migrate"]["command"])
    assert (REPO / "Dockerfile").is_file()


def test_engine_host_spec_loads_and_router_targets_its_worker():
    cmd = SERVICES["engine-host"]["command"]
    env = {
        k: v.split(":-", 1)[-1].strip("${}") if v.startswith("${") else v
        for k, v in _env("engine-host").items()
    }
    env["KVFLEET_WORKER_ADMIN_KEY"] = "test-key"
    spec = load_spec(REPO / cmd[cmd.index("--spec") + 1], env)
    (worker,) = spec.workers
    router_cmd = SERVICES["router"]["command"]
    assert router_cmd[router_cmd.index("--worker-urls") + 1] == worker.url == "http://engine-host:30000"
    assert SERVICES["engine-host"]["ports"] == [f"${{WORKER_PORT:-30000}}:{worker.port}"]
    (extra,) = [f for f in worker.flags if f.startswith("--hicache-storage-backend-extra-config=")]
    assert '"master_server_address": "mooncake-master:50051"' in extra
    assert "-rpc_port=50051" in SERVICES["mooncake-master"]["command"][-1]
    assert "-http_metadata_server_port=8080" in SERVICES["mooncake-master"]["command"][-1]
    assert _env("engine-host")["KVFLEET_CONTROL_PLANE"] == "http://web:8000"
    assert SERVICES["web"]["command"][-1] == "controlplane.asgi:application"


def test_the_router_starts_with_kvfleets_resilience_flags():
    """Same flags as the demo's router (engine/fleet/router.py ROUTER_FLAGS): no breaker, fast health checks,
    retries that outlast them."""
    from engine.fleet.router import ROUTER_FLAGS

    cmd = [str(a) for a in SERVICES["router"]["command"]]
    at = cmd.index(ROUTER_FLAGS[0])
    assert tuple(cmd[at : at + len(ROUTER_FLAGS)]) == ROUTER_FLAGS
    assert "--disable-health-check" not in cmd


def test_every_redis_kvfleet_starts_persists_its_queue():
    """Same append-only settings in compose (on a volume), the demo and scripts/services.sh (CI, make)."""
    from localfleet import REDIS_PERSISTENCE

    cmd = SERVICES["redis"]["command"]
    at = cmd.index(REDIS_PERSISTENCE[0])
    assert tuple(cmd[at : at + len(REDIS_PERSISTENCE)]) == REDIS_PERSISTENCE
    assert "redisdata:/data" in SERVICES["redis"]["volumes"]  # the image's working directory
    services = (REPO / "scripts" / "services.sh").read_text()
    assert " ".join(REDIS_PERSISTENCE) in services and "--appendonly no" not in services


# A router's launch spelled as an argv: "-m", "smg" / "smg.launch_router" / "sglang_router.launch_router".
LAUNCH = re.compile(r"""["']-m["'],\s*["'](smg|smg\.launch_router|sglang_router\.launch_router)["']""")


def test_every_router_kvfleet_starts_is_built_by_router_command():
    """No module spells its own router command line, smg's or sglang-router's (compose's is checked above)."""
    builder, this = REPO / "engine" / "fleet" / "router.py", Path(__file__).resolve()
    own = [
        str(path.relative_to(REPO))
        for top in ("controlplane", "deploy", "engine", "tests")
        for path in (REPO / top).rglob("*.py")
        if path not in (builder, this) and LAUNCH.search(path.read_text())
    ]
    assert own == []
