"""The agent's fleet spec: a TOML file listing the engine workers one host runs.

Layout (every worker key other than ``name``, ``model``, ``role``, ``url`` and ``env`` is an SGLang launch
arg by its ``ServerArgs`` name, e.g. ``page_size``, ``max_total_tokens``, ``enable_hierarchical_cache``,
``hicache_ratio``, ``hicache_storage_backend``; a table value becomes JSON, so
``hicache_storage_backend_extra_config`` may be an inline table)::

    [agent]                      # optional
    host_name = "gpu-node-1"     # default: this machine's hostname
    address = "10.0.0.5"         # address the workers are reached at (default 127.0.0.1)
    log_dir = "logs/agent"       # worker logs and the state file
    heartbeat_interval_s = 5
    metrics_interval_s = 3
    buffer_size = 500            # samples kept while the control plane is down
    health_interval_s = 5        # how often a running worker's /health is probed
    unhealthy_after = 3          # consecutive failed probes before the worker is restarted

    [[workers]]
    name = "w0"
    model = "smollm2"
    role = "mixed"               # mixed | prefill | decode | encoder (or disaggregation_mode = "prefill")
    port = 30001
    enable_hierarchical_cache = true
    hicache_storage_backend = "mooncake"
    hicache_storage_backend_extra_config = { master_server_address = "${MOONCAKE_MASTER}" }

PD workers take SGLang's PD flags as keys (``disaggregation_bootstrap_port``,
``disaggregation_transfer_backend``, ``disaggregation_ib_device``, ``enable_pd_role_switch``, ...);
``disaggregation_mode`` may stand for ``role`` (``"null"`` = mixed; giving both with different roles is an
error). :func:`with_role` rebuilds a worker's flags for another role (the agent restarts it with them when
the control plane asks).

Strings may reference the environment as ``${VAR}`` or ``${VAR:-default}``. Every value is checked with the
engine's own argument parser before anything starts; any problem raises :class:`SpecError` naming the file,
the line and the field.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.server.args import SECRET_ENV, ArgumentError, build_parser, parse_args

ROLES = {"mixed": "null", "prefill": "prefill", "decode": "decode"}
ROLE_OF_MODE = {mode: role for role, mode in ROLES.items()}
ENCODER = "encoder"  # EPD: an --encoder-only worker (vision tower only); its role is never switched
_ENCODER_FLAG = "--encoder-only"
AGENT_KEYS = {
    "host_name": str,
    "address": str,
    "log_dir": str,
    "heartbeat_interval_s": (int, float),
    "metrics_interval_s": (int, float),
    "buffer_size": int,
    "health_interval_s": (int, float),
    "unhealthy_after": int,
}
WORKER_META_KEYS = {"name", "model", "role", "url", "env"}
# Launch args the agent sets itself from other fields (model, role, port are fields of their own).
_RESERVED_ARGS = {"model_path"}
_MODE_FLAG = "--disaggregation-mode="
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_HEADER = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\"-]+)\s*\]\]?")
_KEY = re.compile(r"^\s*\"?([A-Za-z0-9_-]+)\"?\s*=")


class SpecError(ValueError):
    """A bad spec file; ``str()`` is ``"<file>:<line>: <field>: <problem>"``."""

    def __init__(self, path: str, line: int | None, field_name: str, problem: str):
        self.path, self.line, self.field, self.problem = path, line, field_name, problem
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {field_name}: {problem}")


@dataclass
class WorkerSpec:
    """One engine worker: its identity and the exact ``python -m engine.launch_server`` flags."""

    name: str
    model: str
    role: str
    host: str
    port: int
    url: str
    flags: list[str]
    env: dict[str, str] = field(default_factory=dict)
    admin_api_key: str | None = None
    api_key: str | None = None
    page_size: int = 1
    model_name: str = ""
    tp_size: int = 1  # ranks (devices) this worker spans
    base_gpu_id: int = 0  # its first device; the others follow (upstream's --base-gpu-id)
    device: str = "cpu"  # --device: cpu ranks hold no GPU

    @property
    def devices(self) -> list[int]:
        """Device indexes the worker holds: ``--base-gpu-id`` .. + ``--tp-size`` - 1."""
        return list(range(self.base_gpu_id, self.base_gpu_id + self.tp_size))


@dataclass
class FleetSpec:
    path: str
    host_name: str
    address: str
    log_dir: str
    heartbeat_interval_s: float
    metrics_interval_s: float
    buffer_size: int
    workers: list[WorkerSpec]
    health_interval_s: float = 5.0
    unhealthy_after: int = 3

    @property
    def state_file(self) -> str:
        return os.path.join(self.log_dir, "agent-state.json")


class _Locator:
    """Finds the line of ``[table] key`` or ``[[table]] #index key`` in the TOML text (1-based)."""

    def __init__(self, text: str):
        self.lines = text.splitlines()

    def line_of(self, table: str, index: int | None, key: str | None, sub: str | None = None) -> int | None:
        seen, start, end = -1, None, len(self.lines)
        for i, line in enumerate(self.lines):
            m = _HEADER.match(line)
            if not m:
                continue
            name = m.group(2).replace('"', "")
            if start is not None and not name.startswith(table + "."):
                end = i
                break
            if name == table:
                seen += 1
                if index is None or seen == index:
                    start = i
        if start is None:
            return None
        if key is None:
            return start + 1
        found = None
        for i in range(start + 1, end):
            m = _KEY.match(self.lines[i])
            header = _HEADER.match(self.lines[i])
            is_subtable = header and header.group(2).replace('"', "") == f"{table}.{key}"
            if (m and m.group(1) == key) or is_subtable:
                found = i
                break
        if found is None:
            return start + 1
        if sub is not None:
            for i in range(found, end):
                if re.search(rf"(^|[\s{{,]){re.escape(sub)}\s*=", self.lines[i]):
                    return i + 1
        return found + 1


def _expand(value, where: str, err, environ=None):
    """Replace ``${VAR}`` / ``${VAR:-default}`` in every string inside ``value`` (from ``environ``)."""
    environ = os.environ if environ is None else environ
    if isinstance(value, str):

        def sub(m: re.Match) -> str:
            var, default = m.group(1), m.group(2)
            if var in environ:
                return environ[var]
            if default is not None:
                return default
            raise err(f"environment variable {var} is not set (referenced as ${{{var}}})")

        return _ENV_REF.sub(sub, value)
    if isinstance(value, dict):
        return {k: _expand(v, f"{where}.{k}", err, environ) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, where, err, environ) for v in value]
    return value


def _flag_actions() -> dict[str, object]:
    """SGLang dest name -> argparse action of ``engine.launch_server``."""
    return {a.dest: a for a in build_parser()._actions if a.option_strings and a.dest != "help"}


def _to_flags(name: str, value, action, err) -> list[str]:
    """``--flag=value`` (one argv item, so a value starting with ``-`` is not read as a flag)."""
    flag = action.option_strings[0]
    if action.nargs == 0:  # store_true
        if not isinstance(value, bool):
            raise err(f"must be true or false, got {value!r}")
        return [flag] if value else []
    if isinstance(value, bool | list):
        raise err(f"must be a string, number or table, got {value!r}")
    if isinstance(value, dict):
        return [f"{flag}={json.dumps(value)}"]
    return [f"{flag}={value}"]


def load_spec(path: str | os.PathLike, environ: dict | None = None) -> FleetSpec:
    """Read and validate a fleet spec; raises :class:`SpecError` (file, line, field) or ``OSError``.

    ``${VAR}`` references are filled from ``environ`` (default ``os.environ``).
    """
    path = str(path)

    def expand(value, where, err):
        return _expand(value, where, err, environ)

    text = Path(path).read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"at line (\d+)", str(exc))
        raise SpecError(path, int(m.group(1)) if m else None, "toml", str(exc)) from None
    loc = _Locator(text)

    def error_at(table: str, index: int | None, key: str | None, sub: str | None = None):
        label = f"{table}[{index}]" if index is not None else table
        label = f"{label}.{key}" if key else label
        label = f"{label}.{sub}" if sub else label
        return lambda problem: SpecError(path, loc.line_of(table, index, key, sub), label, problem)

    unknown = sorted(set(data) - {"agent", "workers"})
    if unknown:
        raise SpecError(
            path,
            loc.line_of(unknown[0], None, None) or 1,
            unknown[0],
            "unknown table (use [agent], [[workers]])",
        )
    agent = data.get("agent", {})
    if not isinstance(agent, dict):
        raise error_at("agent", None, None)("must be a table")
    for key, value in agent.items():
        err = error_at("agent", None, key)
        if key not in AGENT_KEYS:
            raise err(f"unknown field; {_closest(key, AGENT_KEYS)}")
        if isinstance(value, bool) or not isinstance(value, AGENT_KEYS[key]):
            raise err(f"has the wrong type: {value!r}")
    agent = {k: expand(v, k, error_at("agent", None, k)) for k, v in agent.items()}
    for key in (
        "heartbeat_interval_s",
        "metrics_interval_s",
        "buffer_size",
        "health_interval_s",
        "unhealthy_after",
    ):
        if key in agent and agent[key] <= 0:
            raise error_at("agent", None, key)(f"must be > 0, got {agent[key]}")
    address = agent.get("address", "127.0.0.1")

    raw_workers = data.get("workers")
    if not isinstance(raw_workers, list) or not raw_workers:
        raise SpecError(path, None, "workers", "the spec lists no [[workers]]")
    actions = _flag_actions()
    workers, names, ports = [], set(), set()
    for i, raw in enumerate(raw_workers):
        workers.append(_worker(raw, i, address, actions, error_at, expand))
        w = workers[-1]
        if w.name in names:
            raise error_at("workers", i, "name")(f"duplicate worker name {w.name!r}")
        if (w.host, w.port) in ports:
            raise error_at("workers", i, "port")(f"port {w.port} is used by another worker")
        names.add(w.name)
        ports.add((w.host, w.port))
    return FleetSpec(
        path=path,
        host_name=agent.get("host_name") or socket.gethostname(),
        address=address,
        log_dir=agent.get("log_dir", "logs/agent"),
        heartbeat_interval_s=float(agent.get("heartbeat_interval_s", 5)),
        metrics_interval_s=float(agent.get("metrics_interval_s", 3)),
        buffer_size=int(agent.get("buffer_size", 500)),
        workers=workers,
        health_interval_s=float(agent.get("health_interval_s", 5)),
        unhealthy_after=int(agent.get("unhealthy_after", 3)),
    )


def _closest(key: str, known, otherwise: str | None = None) -> str:
    """``"did you mean 'x'?"`` for the closest of ``known`` to ``key``, else ``otherwise`` (default: the
    ``known`` keys listed)."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return otherwise or f"known: {', '.join(sorted(known))}"


def _worker(raw, i: int, address: str, actions: dict, error_at, expand) -> WorkerSpec:  # noqa: C901
    if not isinstance(raw, dict):
        raise error_at("workers", i, None)("must be a table")
    for key in ("name", "model", "port"):
        if key not in raw:
            raise error_at("workers", i, None)(f"missing required field {key!r}")
    flags: list[str] = []
    flag_field: dict[str, str] = {}
    for key, value in raw.items():
        err = error_at("workers", i, key)
        if key in WORKER_META_KEYS or key == "disaggregation_mode":
            continue
        if key in _RESERVED_ARGS or key not in actions:
            known = [*WORKER_META_KEYS, *(k for k in actions if k not in _RESERVED_ARGS)]
            hint = _closest(key, known, "worker keys: name, model, role, url, env and its launch args")
            raise err(f"unknown field; {hint}")
        if isinstance(value, dict):
            value = {sub: expand(v, sub, error_at("workers", i, key, sub)) for sub, v in value.items()}
        else:
            value = expand(value, key, err)
        before = len(flags)
        flags += _to_flags(key, value, actions[key], err)
        for flag in flags[before : before + 1]:
            flag_field[flag.split("=", 1)[0]] = key
    meta = {k: expand(raw[k], k, error_at("workers", i, k)) for k in WORKER_META_KEYS if k in raw}
    for key in ("name", "model"):
        if not isinstance(meta[key], str) or not meta[key]:
            raise error_at("workers", i, key)("must be a non-empty string")
    role = meta.get("role", "mixed")
    if role not in (*ROLES, ENCODER):
        raise error_at("workers", i, "role")(f"must be one of {', '.join((*ROLES, ENCODER))}, got {role!r}")
    if _ENCODER_FLAG in flags and "role" not in raw:  # encoder_only = true names the role too
        role = ENCODER
    if role == ENCODER and "disaggregation_mode" in raw:
        raise error_at("workers", i, "disaggregation_mode")("an encoder is not a PD worker")
    if "disaggregation_mode" in raw:
        mode = expand(
            raw["disaggregation_mode"], "disaggregation_mode", error_at("workers", i, "disaggregation_mode")
        )
        if mode not in ROLE_OF_MODE:
            raise error_at("workers", i, "disaggregation_mode")(
                f"must be null, prefill or decode, got {mode!r}"
            )
        if "role" in raw and ROLE_OF_MODE[mode] != role:
            raise error_at("workers", i, "disaggregation_mode")(f"{mode!r} contradicts role = {role!r}")
        role = ROLE_OF_MODE[mode]
    env = meta.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise error_at("workers", i, "env")("must be a table of strings")
    flags = [f"--model-path={meta['model']}", *_role_flags(flags, role)]
    try:
        args = parse_args(flags)
    except ArgumentError as exc:
        key = next((k for f, k in flag_field.items() if f in str(exc)), None)
        if key is None and "--disaggregation-mode" in str(exc):
            key = "role"
        raise error_at("workers", i, key)(str(exc)) from None
    # Secrets go to the worker through its environment, never its command line (ps shows that to everyone).
    secret_flags = tuple("--" + name.replace("_", "-") + "=" for name in SECRET_ENV)
    flags = [f for f in flags if not f.startswith(secret_flags)]
    env = {**env, **{var: getattr(args, name) for name, var in SECRET_ENV.items() if getattr(args, name)}}
    url = meta.get("url") or f"http://{address}:{args.port}"
    return WorkerSpec(
        name=meta["name"],
        model=meta["model"],
        role=role,
        host=args.host,
        port=args.port,
        url=url.rstrip("/"),
        flags=flags,
        env=env,
        admin_api_key=args.admin_api_key,
        api_key=args.api_key,
        page_size=args.page_size,
        model_name=args.model_name,
        tp_size=args.tp_size,
        base_gpu_id=args.base_gpu_id,
        device=args.device,
    )


def _role_flags(flags: list[str], role: str) -> list[str]:
    kept = [f for f in flags if not f.startswith(_MODE_FLAG)]
    if role == ENCODER:
        return kept if _ENCODER_FLAG in kept else [*kept, _ENCODER_FLAG]
    return kept if role == "mixed" else [*kept, f"{_MODE_FLAG}{ROLES[role]}"]


def with_role(w: WorkerSpec, role: str) -> WorkerSpec:
    """``w`` launched in ``role`` (mixed | prefill | decode) instead: its flags with ``--disaggregation-mode``
    replaced, everything else (bootstrap port, transfer backend, role switch, cache) unchanged. Raises
    ``ValueError`` for an unknown role or flags the engine's parser refuses in that role (e.g.
    ``--enable-pd-role-switch`` on a mixed worker)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if w.role == ENCODER:
        raise ValueError(f"worker {w.name!r} is an EPD encoder: its role is not switched")
    flags = _role_flags(w.flags, role)
    try:
        parse_args(flags)
    except ArgumentError as exc:
        raise ValueError(f"worker {w.name} cannot run as {role}: {exc}") from None
    return replace(w, role=role, flags=flags)
