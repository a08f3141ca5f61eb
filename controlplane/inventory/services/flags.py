"""A worker's launch flags: the command line its agent runs it with, the change a restart-with-flags
operation makes to it, and the request for that restart asked of its agent.

A command line is the list of launch args as the agent reports them (``EngineWorker.command_line``): one
argv item per flag, ``--flag=value`` or a bare ``--switch``, no interpreter and no secrets. A change is
``{"set": {name: value}, "remove": [name]}`` by SGLang flag names (``page_size``; ``--page-size`` and
``page-size`` are read as the same), checked against the flags the worker's own engine knows
(``EngineWorker.launch_flags``, reported by its agent: for upstream SGLang, that interpreter's parser).
The request travels like the role request (``roles.py``): ``desired_flags`` with its generation
``flags_request_seq`` in the agent's heartbeat answer; the agent acknowledges ``applied`` (the worker
answered /health with those flags) or ``failed`` (refused by the engine's parser, or the process exited
before answering), with why.
"""

from __future__ import annotations

import difflib
import functools
import json

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlplane.audit.services import audit_record
from controlplane.inventory.models import EngineWorker
from engine.server.contract import WORKER_SECRET_FIELDS

# Flags a restart may not change, and what to do instead.
FIXED_FLAGS = {
    "model_path": "the model it serves is what the worker is: add a worker for another model",
    "port": "its address is how the router and the control plane know it: add a worker instead",
    "host": "its address is how the router and the control plane know it: add a worker instead",
    "disaggregation_mode": "its PD role changes through a rebalance or POST .../role/",
    "encoder_only": "an encoder's role is fixed: add a worker instead",
}


def flag_name(name: str) -> str:
    """``--page-size`` / ``page-size`` / ``page_size`` -> ``page_size``."""
    return str(name).strip().lstrip("-").replace("-", "_")


def _option(item: str) -> str:
    return item.split("=", 1)[0]


def _value_item(option: str, takes_value: bool, value) -> str | None:
    """The argv item for ``value`` (None: a switch set to false, i.e. left out)."""
    if not takes_value:
        return option if value else None
    if isinstance(value, dict):
        return f"{option}={json.dumps(value, sort_keys=True)}"
    return f"{option}={value}"


def flags_edit(command_line: list[str], launch_flags: dict, change: dict) -> list[str]:
    """``command_line`` with ``change`` made: a set flag replaces the item in its place (or is appended), a
    removed one is dropped (a switch set to false too). Idempotent: editing the result again returns it
    unchanged, so "already changed" is ``flags_edit(x) == x``. Names must be valid
    (:func:`flags_problems`)."""
    out = list(command_line)
    for name in change.get("remove") or []:
        option = launch_flags[flag_name(name)][0]
        out = [item for item in out if _option(item) != option]
    for name, value in (change.get("set") or {}).items():
        option, takes_value = launch_flags[flag_name(name)][:2]
        item = _value_item(option, takes_value, value)
        at = next((i for i, x in enumerate(out) if _option(x) == option), None)
        out = [x for x in out if _option(x) != option]
        if item is not None:
            out.insert(len(out) if at is None else at, item)
    return out


def _closest(name: str, known) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else "no launch flag is close to it"


@functools.cache
def _kvfleet_flags() -> frozenset[str]:
    """The SGLang names of KVFleet's engine's launch flags (its own parser; no model stack is loaded)."""
    from engine.server.args import build_parser
    from engine.unknown_flags import flag_actions

    return frozenset(a.dest for a in flag_actions(build_parser()))


def _name_problem(worker: EngineWorker, name: str) -> str:
    """'' when ``worker`` can take ``name`` in a change, else why not (naming the closest real flag)."""
    if name in WORKER_SECRET_FIELDS:
        return (
            f"{worker.name}: {name} is a secret: it stays in the agent's spec (the worker's environment), "
            "never in an operation or the audit log"
        )
    if name in FIXED_FLAGS:
        return f"{worker.name}: {name} cannot change by a restart: {FIXED_FLAGS[name]}"
    if name in worker.launch_flags:
        return ""
    engine = f"SGLang {worker.engine_version}" if worker.engine == "sglang" else "KVFleet's engine"
    if worker.engine == "sglang" and name in _kvfleet_flags():
        return f"{worker.name}: {name} is KVFleet's own flag: {engine} has none"
    if worker.engine != "sglang":  # an upstream flag KVFleet leaves out says so, as the engine's CLI does
        from engine.server.upstream_flags import explain

        why = explain("--" + name.replace("_", "-"))
        if why:
            return f"{worker.name}: {why}"
    return f"{worker.name}: not a launch flag of {engine}; {_closest(name, worker.launch_flags)}"


def _value_problem(worker: EngineWorker, name: str, value) -> str:
    takes_value = worker.launch_flags[name][1]
    if not takes_value and not isinstance(value, bool):
        return f"{worker.name}: {name} is a switch: true or false, got {value!r}"
    if takes_value and (isinstance(value, bool | list) or value is None):
        return f"{worker.name}: {name} takes a value (a string, number or object), got {value!r}"
    return ""


def restart_unsupported(worker: EngineWorker) -> str:
    """'' when ``worker`` can be restarted with other flags (an agent runs it and reported its command
    line and its engine's flags), else why not."""
    if worker.host_id is None:
        return "no agent runs it (added by hand): restart it with other flags where it was started"
    if not worker.command_line or not worker.launch_flags:
        return "its agent has not reported its command line and flags (an older agent?): upgrade the agent"
    return ""


def flags_problems(workers: list[EngineWorker], change: dict) -> dict:
    """The 400 ``detail`` for a change some of ``workers`` cannot take ({} when all can):
    ``{"flags": {"set": {name: [why]}, "remove": {name: [why]}}}`` or ``{"flags": [why]}`` for the shape.
    A name is checked on every worker: unknown to its engine (naming the closest real flag, or "KVFleet's
    own flag" on upstream), a secret, a flag no restart changes (``FIXED_FLAGS``); a value is checked for
    its kind (a switch takes true/false); a removed flag must be on the worker's command line."""
    if not isinstance(change, dict) or set(change) - {"set", "remove"}:
        return {"flags": ["an object {set: {flag: value}, remove: [flag]}"]}
    to_set, to_remove = change.get("set") or {}, change.get("remove") or []
    if not isinstance(to_set, dict) or not isinstance(to_remove, list):
        return {"flags": ["set is an object of flag: value, remove a list of flag names"]}
    if not to_set and not to_remove:
        return {"flags": ["set or remove at least one flag"]}
    both = sorted({flag_name(n) for n in to_set} & {flag_name(n) for n in to_remove})
    if both:
        return {"flags": [f"set and removed at once: {', '.join(both)}"]}
    problems: dict[str, dict[str, list[str]]] = {}
    for part, names in (("set", list(to_set)), ("remove", to_remove)):
        for raw in names:
            name = flag_name(raw)
            for worker in workers:
                why = _name_problem(worker, name)
                if not why and part == "set":
                    why = _value_problem(worker, name, to_set[raw])
                if not why and part == "remove":
                    option = worker.launch_flags[name][0]
                    if all(_option(x) != option for x in worker.command_line):
                        why = f"{worker.name}: {option} is not on its command line"
                if why:
                    problems.setdefault(part, {}).setdefault(str(raw), []).append(why)
    return {"flags": problems} if problems else {}


def flags_normalized(change: dict) -> dict:
    """The change with flag names as SGLang names (what the operation stores)."""
    return {
        "set": {flag_name(k): v for k, v in (change.get("set") or {}).items()},
        "remove": [flag_name(n) for n in change.get("remove") or []],
    }


def worker_flags_request(*, worker: EngineWorker, flags: list[str], actor, reason: str = "") -> int:
    """Ask the worker's agent to restart it with ``flags`` (a whole command line; the agent gets it in its
    next heartbeat answer); returns the request's generation (``flags_request_seq``). Audited with the
    before/after command line. A newer request replaces an older one the agent has not carried out; the
    same ``flags`` while that request is still pending are that request (its generation, nothing audited
    again), so a step run twice (a retried task beside a live one) asks the agent once."""
    with transaction.atomic():
        locked = EngineWorker.objects.select_for_update().get(pk=worker.pk)
        pending = locked.flags_request_seq > max(locked.flags_applied_seq, locked.flags_failed_seq)
        if pending and locked.desired_flags == list(flags):
            return locked.flags_request_seq
        EngineWorker.objects.filter(pk=worker.pk).update(
            desired_flags=list(flags), flags_request_seq=F("flags_request_seq") + 1, updated_at=timezone.now()
        )
        seq = EngineWorker.objects.values_list("flags_request_seq", flat=True).get(pk=worker.pk)
        audit_record(
            action="restart_requested",
            obj=locked,
            before={"command_line": locked.command_line},
            after={"command_line": list(flags), "flags_request_seq": seq},
            actor=actor,
            message=reason,
        )
    return seq


def worker_flags_progress(worker: EngineWorker, seq: int) -> tuple[str, str]:
    """Where request ``seq`` of ``worker`` stands, as its agent last reported: ("applied", ""),
    ("failed", why) or ("waiting", what is known). A newer request (another operation's) counts as
    waiting on this one's behalf: the caller compares command lines."""
    row = EngineWorker.objects.values(
        "flags_request_seq", "flags_applied_seq", "flags_failed_seq", "flags_failure", "state"
    ).get(pk=worker.pk)
    if row["flags_failed_seq"] >= seq and row["flags_failed_seq"] > row["flags_applied_seq"]:
        return "failed", row["flags_failure"] or "its agent reported the restart failed"
    if row["flags_applied_seq"] >= seq:
        return "applied", ""
    return "waiting", f"its agent has not carried out request #{seq} yet (worker {row['state']})"


def pending_flag_requests(rows: dict) -> list[dict]:
    """The heartbeat answer's ``flags`` list: [{worker_url, flags, seq}] of the rows (URL -> a dict with
    the FLAGS_REQUEST_FIELDS) whose newest request its agent has neither carried out nor failed."""
    return [
        {"worker_url": url, "flags": w["desired_flags"], "seq": w["flags_request_seq"]}
        for url, w in rows.items()
        if w["desired_flags"] is not None
        and w["flags_request_seq"] > max(w["flags_applied_seq"], w["flags_failed_seq"])
    ]
