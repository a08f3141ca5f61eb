"""``kvfleet-agent`` (``python -m engine.agent``): run | status | drain | undrain | check-isolation.

- ``run --control-plane URL --token TOKEN --spec fleet.toml``: supervise the spec's workers and report them.
- ``status --state-file FILE`` (or ``--spec fleet.toml``): one row per worker: supervisor state, restarts,
  idle, running/waiting requests and cached tokens per tier (device/host/storage) read live from the
  worker. The state file (``agent-state.json`` in the spec's ``log_dir``, rewritten by a running agent every
  heartbeat) holds the workers as the agent resolved them, so it needs nothing else; ``--spec`` finds it
  through the spec, whose ``${...}`` values must then be set as when the agent started.
- ``drain WORKER --control-plane URL --token TOKEN``: the control plane takes the worker out of its router
  (``POST /api/v1/inventory/workers/{id}/drain/``, operator token), then wait until the worker is idle
  (``--timeout`` seconds, > 0). A drain that times out leaves the worker out of its router, and says so.
- ``undrain WORKER --control-plane URL --token TOKEN``: put the worker back into its router
  (``POST .../undrain/``): the way back from a drain.
- ``check-isolation URL [--api-key-file FILE] [--words N] [--json]``: the cache isolation self-test
  (``engine.agent.isolation``): same prompt, two salts → no reuse; same salt → reuse; both TTFTs. Exit 0
  when isolated, 1 when not, inconclusive (a router with more than one worker) or the worker failed; URL
  may be a worker or a router (smg or sglang-router: each salt route is checked through it); the key
  defaults to ``$KVFLEET_API_KEY``.

``--control-plane``, ``--token`` and ``--token-file`` default to ``$KVFLEET_CONTROL_PLANE``,
``$KVFLEET_AGENT_TOKEN`` and ``$KVFLEET_AGENT_TOKEN_FILE``.
Errors (an unknown flag, named before any missing required one, under its command's usage, with the
closest real flag of that command; an unknown command, with the closest real one; a flag before the
command, with the command line it belongs in; bad spec, missing flag,
control plane refusal) print one line and exit 2 (usage) or 1; a bad spec or an unknown flag starts nothing.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
import time
from pathlib import Path

from engine.agent.host import AGENT_VERSION
from engine.agent.probe import cached_tokens, metrics_text, server_info
from engine.agent.reporter import ControlPlaneClient, ControlPlaneDown, ControlPlaneRejected
from engine.agent.spec import SpecError, load_spec
from engine.unknown_flags import closest_flags, own_actions, parse_args, subcommands


class CliError(Exception):
    """A user-facing failure; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def positive_seconds(text: str) -> float:
    """``--timeout``'s type: a number of seconds > 0 (argparse names the flag in its error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet-agent", description="KVFleet engine agent for one host")
    p.add_argument("--version", action="version", version=AGENT_VERSION)
    sub = p.add_subparsers(dest="command", required=True)

    def control_plane_flags(sp):
        sp.add_argument("--control-plane", default=os.environ.get("KVFLEET_CONTROL_PLANE"), help="base URL")
        sp.add_argument(
            "--token",
            default=os.environ.get("KVFLEET_AGENT_TOKEN"),
            help="API token cp_... (other users see it in `ps`: prefer $KVFLEET_AGENT_TOKEN or --token-file)",
        )
        sp.add_argument("--token-file", default=os.environ.get("KVFLEET_AGENT_TOKEN_FILE"),
                        help="read the token from this file (e.g. a container secret)")  # fmt: skip

    run = sub.add_parser("run", help="launch, supervise and report this host's workers")
    control_plane_flags(run)
    run.add_argument("--spec", required=True, help="fleet spec (TOML)")
    run.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    status = sub.add_parser("status", help="table of workers: state, idle, cached tokens per tier")
    which = status.add_mutually_exclusive_group(required=True)
    which.add_argument("--state-file", help="a running agent's agent-state.json (in its spec's log_dir)")
    which.add_argument("--spec", help="fleet spec (TOML) whose workers to show")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    drain = sub.add_parser("drain", help="take a worker out of its router and wait until it is idle")
    drain.add_argument("worker", help="worker name as registered")
    control_plane_flags(drain)
    drain.add_argument(
        "--timeout", type=positive_seconds, default=300.0, help="seconds to wait for idle (> 0, default 300)"
    )
    undrain = sub.add_parser("undrain", help="put a drained worker back into its router")
    undrain.add_argument("worker", help="worker name as registered")
    control_plane_flags(undrain)
    iso = sub.add_parser("check-isolation", help="same prompt, two salts: no reuse; same salt: reuse")
    iso.add_argument("url", help="the worker's (or its router's) base URL")
    iso.add_argument("--api-key", default=None, help="bearer key (prefer --api-key-file or $KVFLEET_API_KEY)")
    iso.add_argument("--api-key-file", default=None, help="read the bearer key from this file")
    iso.add_argument("--words", type=int, default=400, help="prompt length in words (default 400)")
    iso.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def cmd_check_isolation(args) -> int:
    from engine.agent.isolation import IsolationCheckError, check_isolation, format_report

    key = args.api_key
    if key is None and args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as exc:
            raise CliError(f"--api-key-file {args.api_key_file}: {exc.strerror}", 2) from None
    key = key or os.environ.get("KVFLEET_API_KEY") or None
    if args.words < 32:
        raise CliError(f"--words must be >= 32 (the prompt must span cache pages), got {args.words}", 2)
    try:
        report = check_isolation(args.url, key, words=args.words)
    except IsolationCheckError as exc:
        raise CliError(str(exc)) from None
    print(json.dumps(report.as_dict(), indent=1) if args.json else format_report(report))
    return 0 if report.ok else 1


def _require_control_plane(args) -> ControlPlaneClient:
    if not args.control_plane:
        raise CliError("--control-plane is required (or set KVFLEET_CONTROL_PLANE)", 2)
    if not args.token and args.token_file:
        try:
            args.token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise CliError(f"--token-file {args.token_file}: {exc.strerror}", 2) from None
    if not args.token:
        raise CliError("--token or --token-file is required (or set KVFLEET_AGENT_TOKEN)", 2)
    return ControlPlaneClient(args.control_plane, args.token)


def _spec(path: str):
    try:
        return load_spec(path)
    except SpecError as exc:
        raise CliError(str(exc), 2) from None
    except OSError as exc:
        raise CliError(f"--spec {path}: {exc.strerror}", 2) from None


def cmd_run(args) -> int:
    spec = _spec(args.spec)
    client = _require_control_plane(args)
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    from engine.agent.agent import Agent

    return Agent(spec, client).run()


def _agent_running(state: dict) -> bool:
    pid = state.get("agent_pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def read_state(path: str) -> dict | None:
    """A running agent's state file (``Agent.write_state``), or None when there is none or it is not one."""
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("workers"), list) else None


def status_rows(spec=None, state: dict | None = None) -> list[dict]:
    """One row per worker: its supervisor state merged with its live state. Workers come from ``state`` (a
    state file's content: each worker's name, URL and local URL as the agent resolved them) or, without one,
    from ``spec`` (merged with the state file its ``log_dir`` holds, if any). A worker of an agent that is no
    longer running shows ``agent stopped`` (or ``down`` when the worker does not answer either)."""
    if state is None:
        state = read_state(spec.state_file) if spec is not None else None
    supervised = {w.get("name"): w for w in (state or {}).get("workers", [])}
    running = state is not None and _agent_running(state)
    if spec is not None:
        workers = [(w.name, w.url, f"http://127.0.0.1:{w.http_port or w.port}") for w in spec.workers]
    else:
        workers = [
            (w.get("name"), w.get("url"), w.get("local_url") or w.get("url")) for w in supervised.values()
        ]
    rows = []
    for name, url, default_local in workers:
        sup = supervised.get(name, {})
        local = sup.get("local_url") or default_local
        info = server_info(local)
        text = metrics_text(local) if info else None
        tiers = cached_tokens(text) if text else {}
        hicache = (info or {}).get("hicache") or {}
        if not info and not sup:
            how = "down"
        elif not sup:
            how = "unsupervised"
        else:
            how = sup.get("state", "unsupervised") if running else ("agent stopped" if info else "down")
        rows.append(
            {
                "worker": name,
                "url": url,
                "state": how,
                "pid": sup.get("pid") if running else None,
                "restarts": sup.get("restarts", 0),
                "idle": info.get("is_idle") if info else None,
                "running": info.get("num_running_reqs") if info else None,
                "waiting": info.get("num_waiting_reqs") if info else None,
                "l3": hicache.get("hicache_storage_backend") if info else None,
                **{t: int(tiers[t]) if tiers else None for t in ("device", "host", "storage")},
            }
        )
    return rows


def _cell(value) -> str:
    if value is None:
        return "-"
    return str(value).lower() if isinstance(value, bool) else str(value)


def format_table(rows: list[dict]) -> str:
    cols = ["worker", "url", "state", "pid", "restarts", "idle", "running", "waiting", "l3", "device",
            "host", "storage"]  # fmt: skip
    cells = [[_cell(r[c]) for c in cols] for r in rows]
    heads = [c.upper() if c not in ("device", "host", "storage") else f"HIT_{c.upper()}" for c in cols]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(wd) for h, wd in zip(heads, widths, strict=True))]
    lines += ["  ".join(v.ljust(wd) for v, wd in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def cmd_status(args) -> int:
    if args.state_file:
        state = read_state(args.state_file)
        if state is None:
            raise CliError(
                f"--state-file {args.state_file}: no agent state there (a running agent writes "
                "agent-state.json in its spec's log_dir)",
                2,
            )
        rows = status_rows(state=state)
    else:
        rows = status_rows(_spec(args.spec))
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0


def _worker_call(args, action: str) -> tuple[dict, dict]:
    """Find worker ``args.worker`` by name and POST its ``action`` (drain / undrain): (worker, answer)."""
    client = _require_control_plane(args)
    try:
        page = client.call("GET", "/api/v1/inventory/workers/", params={"q": args.worker, "limit": 500})
        matches = [w for w in page.get("results", page) if w["name"] == args.worker]
        if not matches:
            raise CliError(f"no worker named {args.worker!r} at {client.base_url}")
        worker = matches[0]
        return worker, client.call("POST", f"/api/v1/inventory/workers/{worker['id']}/{action}/")
    except ControlPlaneRejected as exc:
        raise CliError(f"control plane refused: {exc}") from None
    except ControlPlaneDown as exc:
        raise CliError(f"control plane unreachable at {client.base_url}: {exc}") from None


def cmd_drain(args) -> int:
    worker, out = _worker_call(args, "drain")
    print(f"{args.worker}: {'removed from' if out['removed'] else 'was not in'} router {out['router']}")
    start = time.monotonic()
    while True:
        info = server_info(worker["url"])
        if info is not None and info.get("is_idle"):
            print(f"{args.worker}: idle after {time.monotonic() - start:.1f}s")
            return 0
        if time.monotonic() - start > args.timeout:
            detail = "unreachable"
            if info is not None:
                detail = f"{info.get('num_running_reqs')} running, {info.get('num_waiting_reqs')} waiting"
            raise CliError(
                f"{args.worker} not idle after {args.timeout:g}s ({detail}); it stays out of router "
                f"{out['router']}: put it back with `kvfleet-agent undrain {args.worker}`"
            )
        time.sleep(0.5)


def cmd_undrain(args) -> int:
    _, out = _worker_call(args, "undrain")
    print(f"{args.worker}: {'added to' if out['added'] else 'already in'} router {out['router']}")
    return 0


def check_command(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """An unknown command is a usage error naming the closest real one (argparse lists them all); a flag
    before the command (``kvfleet-agent --control-plane URL run``) is one saying that flags go after the
    command, with the command line they belong in and the closest real flag of that command."""
    commands = subcommands(parser)
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        flag = argv[0].split("=", 1)[0]
        command = next((a for a in argv if a in commands), None)
        if command is None:
            if all(a.startswith("-") for a in argv):
                return  # nothing that could be read as a command: argparse names the unknown flag
            parser.error(f"{flag}: flags go after the command ({', '.join(commands)})")
        known = {o: o for action in own_actions(commands[command]) for o in action.option_strings}
        close = closest_flags(flag, known)
        parser.error(
            f"{flag}: flags go after the command: kvfleet-agent {command} {close[0] if close else flag} ..."
        )
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is None or first in commands:
        return
    close = difflib.get_close_matches(first, list(commands), n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}?" if close else f"commands: {', '.join(commands)}"
    parser.error(f"unknown command {first!r}; {hint}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    check_command(parser, sys.argv[1:] if argv is None else argv)
    args = parse_args(parser, argv)
    handler = {
        "run": cmd_run,
        "status": cmd_status,
        "drain": cmd_drain,
        "undrain": cmd_undrain,
        "check-isolation": cmd_check_isolation,
    }[args.command]
    try:
        return handler(args)
    except CliError as exc:
        print(f"kvfleet-agent {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
