"""The README's hand-written router command is the one engine/fleet/router.py builds: same arguments in the
same order (so KVFleet's ROUTER_FLAGS are in it), and the router's own parser takes every flag: smg's, and
sglang-router 0.3.2's (in its own venv, scripts/sglang_router_env.sh) for deployments that pin it."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from engine.fleet.router import ROUTER_FLAGS, ROUTER_MODULES, router_command, router_python

README = Path(__file__).resolve().parents[2] / "README.md"
LAUNCHER = " ".join(ROUTER_MODULES["smg"])  # "-m smg launch": the README names the router so


def readme_router_commands() -> list[list[str]]:
    """argv (after ``python -m smg launch``) of every router command in the README's bash blocks, with the
    backslash line continuations joined."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line.split(LAUNCHER, 1)[1]) for line in lines if LAUNCHER in line]


def test_the_readme_router_command_is_router_commands():
    (argv,) = readme_router_commands()
    workers = argv[: argv.index("--host")]
    port = int(argv[argv.index("--port") + 1])
    prometheus_port = int(argv[argv.index("--prometheus-port") + 1])
    built = router_command(workers, port, prometheus_port)
    assert built[: 1 + len(ROUTER_MODULES["smg"])] == [router_python("smg"), *ROUTER_MODULES["smg"]]
    assert argv == built[1 + len(ROUTER_MODULES["smg"]) :]
    at = argv.index(ROUTER_FLAGS[0])
    assert tuple(argv[at : at + len(ROUTER_FLAGS)]) == ROUTER_FLAGS


# Run in the router's own python: each kind's launcher parses the README's arguments.
PARSE = {
    "smg": "from smg.launch_router import parse_router_args",
    "sglang-router": "from sglang_router.launch_router import parse_router_args",
}
REPORT = """
import json, sys
{imp}
a = parse_router_args(json.loads(sys.argv[1]))
print(json.dumps({{"pd": a.pd_disaggregation, "prefill": a.prefill_urls, "decode": a.decode_urls,
    "breaker_off": a.disable_circuit_breaker, "interval": a.health_check_interval_secs,
    "retries": a.retry_max_retries, "host": a.host}}))
"""


@pytest.mark.parametrize("kind", ["smg", "sglang-router"])
def test_the_router_parses_the_readme_command(kind, request):
    if kind == "sglang-router":
        request.getfixturevalue("sglang_router_env")
    (argv,) = readme_router_commands()
    code = REPORT.format(imp=PARSE[kind])
    out = subprocess.run(
        [router_python(kind), "-c", code, json.dumps(argv)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    args = json.loads(out.stdout.strip().splitlines()[-1])
    assert args["pd"] and args["prefill"] == [["http://127.0.0.1:8100", 8190]]
    assert args["decode"] == ["http://127.0.0.1:8400"]
    assert args["breaker_off"] and args["interval"] == 1
    assert args["retries"] == 6 and args["host"] == "127.0.0.1"
