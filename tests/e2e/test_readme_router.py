"""The README's hand-written sglang-router command is the one engine/fleet/router.py builds: same arguments in
the same order (so KVFleet's ROUTER_FLAGS are in it), and sglang-router's own parser takes every flag."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

from engine.fleet.router import ROUTER_FLAGS, router_command

README = Path(__file__).resolve().parents[2] / "README.md"
MODULE = router_command([], 0, 0)[2]  # the router's module, named by the builder only


def readme_router_commands() -> list[list[str]]:
    """argv (after ``python -m MODULE``) of every router command in the README's bash blocks, with the
    backslash line continuations joined."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line.split(MODULE, 1)[1]) for line in lines if MODULE in line]


def test_the_readme_router_command_is_router_commands():
    (argv,) = readme_router_commands()
    workers = argv[: argv.index("--host")]
    port = int(argv[argv.index("--port") + 1])
    prometheus_port = int(argv[argv.index("--prometheus-port") + 1])
    built = router_command(workers, port, prometheus_port)
    assert argv == built[3:]
    at = argv.index(ROUTER_FLAGS[0])
    assert tuple(argv[at : at + len(ROUTER_FLAGS)]) == ROUTER_FLAGS


def test_sglang_router_parses_the_readme_command():
    (argv,) = readme_router_commands()
    args = importlib.import_module(MODULE).parse_router_args(argv)
    assert args.pd_disaggregation and args.prefill_urls == [("http://127.0.0.1:8100", 8190)]
    assert args.decode_urls == ["http://127.0.0.1:8400"]
    assert args.disable_circuit_breaker and args.health_check_interval_secs == 1
    assert args.retry_max_retries == 6 and args.host == "127.0.0.1"
