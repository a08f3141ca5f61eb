"""The agent's fleet spec: a TOML file listing the engine workers one host runs.

Layout (every worker key other than ``name``, ``model``, ``role``, ``url``, ``env``, ``engine`` and ``python``
is an SGLang launch arg by its ``ServerArgs`` name, e.g. ``page_size``, ``max_total_tokens``,
``enable_hierarchical_cache``, ``hicache_ratio``, ``hicache_storage_backend``; a table value becomes JSON, so
``hicache_storage_backend_extra_config`` may be an inline table)::

    [agent]                      # optional
    host_name = "gpu-node-1"     # default: this machine's hostname
    address = "10.0.0.5"         # address the workers are reached at (default 127.0.0.1)
    log_dir = "logs/agent"       # worker logs and the state file
    heartbeat_interval_s = 5
    trace_interval_s = 3         # how often recorded traffic (--record-trace) is shipped
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

A worker runs KVFleet's engine unless it says ``engine = "sglang"``: then ``python`` names the interpreter of
an environment with upstream SGLang, its keys are that SGLang's own launch flags (checked against its parser,
``engine/agent/engines.py``; a KVFleet-only flag is an error naming it) and it starts as upstream's
``python -m sglang.launch_server``.

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

from engine.agent.engines import ENGINES, KVFLEET, SGLANG, EngineUnavailable, UpstreamFlags, upstream_flags
from engine.server.args import SECRET_ENV, ArgumentError, build_parser, parse_args
from engine.unknown_flags import flag_actions

ROLES = {"mixed": "null", "prefill": "prefill", "decode": "decode"}
ROLE_OF_MODE = {mode: role for role, mode in ROLES.items()}
ENCODER = "encoder"  # EPD: an --encoder-only worker (vision tower only); its role is never switched
_ENCODER_FLAG = "--encoder-only"
AGENT_KEYS = {
    "host_name": str,
    "address": str,
    "log_dir": str,
    "heartbeat_interval_s": (int, float),
    "trace_interval_s": (int, float),
    "health_interval_s": (int, float),
    "unhealthy_after": int,
}
WORKER_META_KEYS = {"name", "model", "role", "url", "env", "engine", "python"}
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
    http_port: int = 0  # where its HTTP routes answer when not on ``port`` (a --grpc-mode worker's sidecar)
    env: dict[str, str] = field(default_factory=dict)
    admin_api_key: str | None = None
    api_key: str | None = None
    page_size: int = 1
    model_name: str = ""
    tp_size: int = 1  # ranks (devices) this worker spans
    base_gpu_id: int = 0  # its first device; the others follow (upstream's --base-gpu-id)
    device: str = "cpu"  # --device: cpu ranks hold no GPU
    engine: str = KVFLEET  # kvfleet | sglang (engine/agent/engines.py)
    python: str | None = None  # sglang: the interpreter of its SGLang environment
    engine_version: str = ""  # sglang: the version its interpreter reported at spec load

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
    trace_interval_s: float
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
    return {a.dest: a for a in flag_actions(build_parser())}


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
        "trace_interval_s",
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
        used = {w.port, w.http_port or w.port}
        taken = sorted(p for p in used if (w.host, p) in ports)
        if taken:
            raise error_at("workers", i, "port")(f"port {taken[0]} is used by another worker")
        names.add(w.name)
        ports |= {(w.host, p) for p in used}
    return FleetSpec(
        path=path,
        host_name=agent.get("host_name") or socket.gethostname(),
        address=address,
        log_dir=agent.get("log_dir", "logs/agent"),
        heartbeat_interval_s=float(agent.get("heartbeat_interval_s", 5)),
        trace_interval_s=float(agent.get("trace_interval_s", 3)),
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
    meta = {k: expand(raw[k], k, error_at("workers", i, k)) for k in WORKER_META_KEYS if k in raw}
    for key in ("name", "model"):
        if not isinstance(meta[key], str) or not meta[key]:
            raise error_at("workers", i, key)("must be a non-empty string")
    engine = meta.get("engine", KVFLEET)
    if engine not in ENGINES:
        raise error_at("workers", i, "engine")(f"must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == SGLANG:
        return _upstream_worker(raw, meta, i, address, actions, error_at, expand)
    if "python" in raw:
        raise error_at("workers", i, "python")('only an engine = "sglang" worker names its python')
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
        before = len(flags)
        flags += _to_flags(key, _expand_value(value, key, i, error_at, expand), actions[key], err)
        for flag in flags[before : before + 1]:
            flag_field[flag.split("=", 1)[0]] = key
    role = _role(raw, meta, flags, i, error_at, expand)
    env = _env(meta, i, error_at)
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
    # a --grpc-mode worker serves gRPC on --port and its HTTP routes (health, /server_info, metrics, admin:
    # what the agent and the control plane use) on its sidecar's port
    http_port = (args.smg_http_sidecar_port or args.port + 1) if args.grpc_mode else args.port
    url = meta.get("url") or f"http://{address}:{http_port}"
    return WorkerSpec(
        name=meta["name"],
        model=meta["model"],
        role=role,
        host=args.host,
        port=args.port,
        http_port=http_port,
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


def _expand_value(value, key: str, i: int, error_at, expand):
    if isinstance(value, dict):
        return {sub: expand(v, sub, error_at("workers", i, key, sub)) for sub, v in value.items()}
    return expand(value, key, error_at("workers", i, key))


def _env(meta: dict, i: int, error_at) -> dict[str, str]:
    env = meta.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise error_at("workers", i, "env")("must be a table of strings")
    return env


def _role(raw: dict, meta: dict, flags: list[str], i: int, error_at, expand) -> str:
    """The worker's role from ``role`` / ``disaggregation_mode`` / ``encoder_only`` (contradictions
    refused)."""
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
    return role


def _upstream_worker(raw: dict, meta: dict, i: int, address: str, ours: dict, error_at, expand) -> WorkerSpec:
    """An ``engine = "sglang"`` worker: every key other than the worker fields must be a launch flag of the
    SGLang its ``python`` runs (asked with :func:`upstream_flags`); a KVFleet-only flag is refused naming it.
    Values are passed as written: upstream's own parser checks them when the worker starts (its log says
    why)."""
    python = meta.get("python")
    if not isinstance(python, str) or not python:
        raise error_at("workers", i, "python" if "python" in raw else None)(
            'an engine = "sglang" worker needs python = "<its SGLang environment>/bin/python"'
        )
    try:
        up = upstream_flags(python)
    except EngineUnavailable as exc:
        raise error_at("workers", i, "python")(str(exc)) from None
    flags: list[str] = []
    values: dict = {}
    for key, value in raw.items():
        err = error_at("workers", i, key)
        if key in WORKER_META_KEYS or key == "disaggregation_mode":
            continue
        if key in _RESERVED_ARGS or key not in up.flags:
            if key in ours and key not in _RESERVED_ARGS:
                flag = ours[key].option_strings[0]
                raise err(
                    f"{flag} is KVFleet's own flag: SGLang {up.version} has none "
                    '(remove it, or use engine = "kvfleet")'
                )
            known = [*WORKER_META_KEYS, *(k for k in up.flags if k not in _RESERVED_ARGS)]
            raise err(f"unknown field: not a launch flag of SGLang {up.version}; {_closest(key, known)}")
        values[key] = _expand_value(value, key, i, error_at, expand)
        if key in SECRET_ENV:
            continue
        action = _UpstreamAction(up, key)
        flags += _to_flags(key, values[key], action, err)
    role = _role(raw, meta, flags, i, error_at, expand)
    env = {
        **_env(meta, i, error_at),
        **{var: str(values[name]) for name, var in SECRET_ENV.items() if values.get(name)},
    }

    def value(name: str, kind, default):
        got = values.get(name, up.default(name) if name in up.flags else None)
        try:
            return kind(got) if got is not None else default
        except (TypeError, ValueError):
            raise error_at("workers", i, name)(f"must be a {kind.__name__}, got {got!r}") from None

    port = value("port", int, 30000)
    url = meta.get("url") or f"http://{address}:{port}"
    return WorkerSpec(
        name=meta["name"],
        model=meta["model"],
        role=role,
        host=value("host", str, "127.0.0.1"),
        port=port,
        url=url.rstrip("/"),
        flags=[f"--model-path={meta['model']}", *_role_flags(flags, role)],
        env=env,
        admin_api_key=values.get("admin_api_key") or None,
        api_key=values.get("api_key") or None,
        page_size=value("page_size", int, 1),
        model_name=value("served_model_name", str, ""),
        tp_size=value("tp_size", int, 1),
        base_gpu_id=value("base_gpu_id", int, 0),
        device=value("device", str, "cuda"),
        engine=SGLANG,
        python=python,
        engine_version=up.version,
    )


class _UpstreamAction:
    """The two facts :func:`_to_flags` reads of an argparse action, for an upstream flag."""

    def __init__(self, up: UpstreamFlags, dest: str):
        self.option_strings = [up.option(dest)]
        self.nargs = None if up.takes_value(dest) else 0


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
    if w.engine != KVFLEET:  # upstream's own parser checks the new flags when it starts
        return replace(w, role=role, flags=flags)
    try:
        parse_args(flags)
    except ArgumentError as exc:
        raise ValueError(f"worker {w.name} cannot run as {role}: {exc}") from None
    return replace(w, role=role, flags=flags)


# What a restart with other flags never changes: the worker's identity and role (flags that carry a secret
# are refused too: secrets reach a worker through its environment only).
FIXED_OPTIONS = ("--model-path", "--port", "--host", "--disaggregation-mode", _ENCODER_FLAG)


def flag_table(w: WorkerSpec) -> dict[str, list]:
    """``w``'s engine's launch flags: SGLang name -> [option, takes a value] (KVFleet's parser, or the
    upstream interpreter's own, :func:`upstream_flags`). What the agent reports as ``launch_flags``."""
    if w.engine == KVFLEET:
        return {k: [a.option_strings[0], a.nargs != 0] for k, a in _flag_actions().items()}
    return {k: [opt, takes] for k, (opt, takes, _) in upstream_flags(w.python).flags.items()}


def _option_values(flags: list[str]) -> dict[str, str]:
    return {f.split("=", 1)[0]: f.split("=", 1)[1] if "=" in f else "" for f in flags}


def with_flags(w: WorkerSpec, flags: list[str]) -> WorkerSpec:
    """``w`` launched with the command line ``flags`` instead (one ``--flag=value`` or ``--switch`` item
    each, as ``w.flags``). Every option must be one of its engine's (KVFleet's: the whole command line is
    parsed and checked as at spec load; upstream: the names are checked against that interpreter's parser,
    values are upstream's to check when it starts). Raises ``ValueError`` saying why: an unknown option
    (naming the closest), a secret on the command line, or a change of model, port, host or role."""
    table = flag_table(w)
    options = {opt: name for name, (opt, _) in table.items()}
    for item in flags:
        if not isinstance(item, str) or not item.startswith("--"):
            raise ValueError(f"{item!r} is not a --flag or --flag=value item")
        option = item.split("=", 1)[0]
        if option not in options:
            engine = "KVFleet's engine" if w.engine == KVFLEET else f"SGLang {w.engine_version}"
            raise ValueError(f"{option} is not a launch flag of {engine}; {_closest(option, options)}")
        if options[option] in SECRET_ENV:
            raise ValueError(f"{option} carries a secret: it reaches a worker through its environment only")
    old, new = _option_values(w.flags), _option_values(flags)
    for option in FIXED_OPTIONS:
        if old.get(option) != new.get(option):
            change = f"{old.get(option)!r} -> {new.get(option)!r}"
            raise ValueError(f"{option} cannot change by a restart ({change})")
    if w.engine != KVFLEET:

        def number(option: str, default: int) -> int:
            try:
                return int(new[option]) if option in new else default
            except ValueError:  # upstream's parser says so when it starts
                return default

        up = upstream_flags(w.python)
        return replace(
            w,
            flags=list(flags),
            page_size=number("--page-size", int(up.default("page_size") or 1)),
            tp_size=number("--tp-size", 1),
            base_gpu_id=number("--base-gpu-id", 0),
            device=new.get("--device") or up.default("device") or "cuda",
            model_name=new.get("--served-model-name", ""),
        )
    try:
        args = parse_args(list(flags))
    except ArgumentError as exc:
        raise ValueError(f"refused by KVFleet's parser: {exc}") from None
    return replace(
        w,
        flags=list(flags),
        page_size=args.page_size,
        tp_size=args.tp_size,
        base_gpu_id=args.base_gpu_id,
        device=args.device,
        model_name=args.model_name,
    )
