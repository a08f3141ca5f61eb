"""The engines an agent can run, and how each is launched.

``kvfleet`` (the default): ``python -m engine.launch_server`` from the agent's own interpreter, its flags
checked by KVFleet's parser. ``sglang``: upstream SGLang's unmodified ``python -m sglang.launch_server`` from
the interpreter the spec's ``python`` names (an environment of its own: upstream's pins clash with
KVFleet's), its flag names checked against that interpreter's own SGLang parser (:func:`upstream_flags`).

Secrets stay off the command line for both: a KVFleet worker reads ``$KVFLEET_ADMIN_API_KEY`` /
``$KVFLEET_API_KEY`` itself; upstream reads its keys only from ``--admin-api-key`` / ``--api-key``, so an
upstream worker with a key starts through :data:`SGLANG_BOOTSTRAP`, a few lines run with ``python -c`` that
move the keys from the environment into ``sys.argv`` inside the process and then run
``sglang.launch_server`` as ``-m`` would. ``ps`` (``/proc/<pid>/cmdline``) shows the command as executed,
without them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache

KVFLEET = "kvfleet"
SGLANG = "sglang"
ENGINES = (KVFLEET, SGLANG)

# Environment variable -> upstream flag, moved into argv inside the process (never onto the command line).
SECRET_FLAGS = {"KVFLEET_ADMIN_API_KEY": "--admin-api-key", "KVFLEET_API_KEY": "--api-key"}

SGLANG_BOOTSTRAP = (
    "import os, runpy, sys\n"
    f"for var, flag in {sorted(SECRET_FLAGS.items())!r}:\n"
    "    if os.environ.get(var):\n"
    "        sys.argv += [flag, os.environ.pop(var)]\n"
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)\n"
)

_DUMP_FLAGS = (
    "import argparse, json, sglang\n"
    "from sglang.srt.server_args import ServerArgs\n"
    "p = argparse.ArgumentParser()\n"
    "ServerArgs.add_cli_args(p)\n"
    "plain = lambda v: v if isinstance(v, (int, float, str)) else None\n"
    "flags = {a.dest: [a.option_strings[0], a.nargs != 0, plain(a.default)]\n"
    "         for a in p._actions if a.option_strings and a.dest != 'help'}\n"
    "print(json.dumps({'version': sglang.__version__, 'flags': flags}))\n"
)


class EngineUnavailable(RuntimeError):
    """The interpreter named for an upstream worker cannot run SGLang (not found, or ``sglang`` does not
    import); ``str()`` says which and why."""


@dataclass(frozen=True)
class UpstreamFlags:
    """Upstream SGLang's launch flags as its own parser defines them.

    ``flags``: dest -> (first option string, takes a value, default or None); ``version``:
    ``sglang.__version__``.
    """

    version: str
    flags: dict[str, tuple[str, bool, object]]

    def option(self, dest: str) -> str:
        return self.flags[dest][0]

    def takes_value(self, dest: str) -> bool:
        return self.flags[dest][1]

    def default(self, dest: str):
        return self.flags[dest][2]


@lru_cache(maxsize=8)
def upstream_flags(python: str, timeout: float = 120.0) -> UpstreamFlags:
    """Ask ``python`` (an interpreter with ``sglang`` installed) for its launch flags; one call per
    interpreter per process (importing SGLang's argument module takes several seconds). Raises
    :class:`EngineUnavailable`."""
    try:
        done = subprocess.run(
            [python, "-c", _DUMP_FLAGS], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineUnavailable(f"cannot run {python}: {exc}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineUnavailable(f"{python} cannot import SGLang's launch arguments: {last}")
    data = json.loads(done.stdout.strip().splitlines()[-1])
    return UpstreamFlags(data["version"], {k: tuple(v) for k, v in data["flags"].items()})


def launch_command(engine: str, flags: list[str], python: str | None, env: dict[str, str]) -> list[str]:
    """The argv a worker of ``engine`` starts with. ``python``: the upstream interpreter (``sglang`` only);
    ``env``: the worker's environment (an upstream worker with a key in it starts through the bootstrap)."""
    if engine == KVFLEET:
        return [sys.executable, "-m", "engine.launch_server", *flags]
    if engine != SGLANG or not python:
        raise ValueError(
            f"engine must be one of {', '.join(ENGINES)} (sglang with its python), got {engine!r}"
        )
    if any(env.get(var) for var in SECRET_FLAGS):
        return [python, "-c", SGLANG_BOOTSTRAP, *flags]
    return [python, "-m", "sglang.launch_server", *flags]
