"""Flag changes the control plane made (restart-with-flags requests), kept across agent restarts.

The spec file stays what an operator edits; a change a ``restart_with_flags`` operation carried out is kept
beside it in ``<log_dir>/agent-flags.json`` as an edit of the file's command line, per worker name:
``{"spec_flags": [...the file's flags when it was made...], "set": {option: item}, "remove": [option]}``
(``set`` maps ``--page-size`` to the whole ``--page-size=32`` item; a switch's item is the option itself).
Model, port, host and role are never in it (a restart cannot change them; a role follows its own
requests). When the agent starts, a worker whose file flags are still the ``spec_flags`` the edit was made
on runs with the edit applied; one whose file flags changed since drops it (the operator's edit wins),
logged either way. A change back to the file's flags removes the entry.
"""

from __future__ import annotations

import json
import logging
import os

from engine.agent.spec import FIXED_OPTIONS, WorkerSpec, with_flags

log = logging.getLogger("kvfleet.agent")
FILE_NAME = "agent-flags.json"


def _option(item: str) -> str:
    return item.split("=", 1)[0]


def edit_between(file_flags: list[str], flags: list[str]) -> dict:
    """``{"set": {option: item}, "remove": [option]}`` that turns ``file_flags`` into ``flags``, leaving
    out the options a restart cannot change. Empty ``set`` and ``remove`` when they agree."""
    before = {_option(i): i for i in file_flags}
    after = {_option(i): i for i in flags}
    return {
        "set": {o: i for o, i in after.items() if before.get(o) != i and o not in FIXED_OPTIONS},
        "remove": [o for o in before if o not in after and o not in FIXED_OPTIONS],
    }


def apply_edit(flags: list[str], edit: dict) -> list[str]:
    """``flags`` with ``edit`` made: a set option replaces its item in place or is appended; a removed one
    is dropped."""
    sets, removed = dict(edit.get("set") or {}), set(edit.get("remove") or [])
    out = []
    for item in flags:
        o = _option(item)
        if o in removed:
            continue
        out.append(sets.pop(o, item))
    return out + list(sets.values())


def _well_formed(edit) -> bool:
    return (
        isinstance(edit, dict)
        and isinstance(edit.get("spec_flags"), list)
        and isinstance(edit.get("set", {}), dict)
        and isinstance(edit.get("remove", []), list)
    )


class FlagOverrides:
    """The edits in ``<log_dir>/agent-flags.json`` (main thread only)."""

    def __init__(self, log_dir: str, file_flags: dict[str, list[str]]) -> None:
        """``file_flags``: worker name -> the spec file's flags for it."""
        self.path = os.path.join(log_dir, FILE_NAME)
        self._file_flags = {name: list(f) for name, f in file_flags.items()}
        self._edits: dict[str, dict] = {}
        try:
            with open(self.path) as f:
                edits = json.load(f)
        except FileNotFoundError:
            return
        except ValueError as exc:
            log.error("%s is not JSON (%s): flag changes from earlier runs are not applied", self.path, exc)
            return
        if not isinstance(edits, dict) or not all(_well_formed(e) for e in edits.values()):
            log.error(
                "%s is not a table of worker edits: flag changes from earlier runs are not applied", self.path
            )
            return
        self._edits = edits

    def applied(self, w: WorkerSpec) -> WorkerSpec:
        """``w`` (as the spec file has it) with its kept edit made; ``w`` unchanged when there is none, when
        the file's flags changed since the edit (the entry is dropped) or when its engine now refuses the
        edited flags (dropped, with why)."""
        edit = self._edits.get(w.name)
        if edit is None:
            return w
        if edit.get("spec_flags") != list(w.flags):
            log.warning(
                "%s: the spec file's flags changed since a restart changed them: the file's apply", w.name
            )
            self._drop(w.name)
            return w
        try:
            new = with_flags(w, apply_edit(list(w.flags), edit))
        except ValueError as exc:
            log.error("%s: the flags a restart changed no longer start (%s): the file's apply", w.name, exc)
            self._drop(w.name)
            return w
        log.info("%s: starts with the flags a restart changed: %s", w.name, " ".join(new.flags))
        return new

    def record(self, name: str, flags: list[str]) -> None:
        """Worker ``name`` now runs ``flags`` after a flags request: keep the edit from its file flags."""
        file_flags = self._file_flags.get(name)
        if file_flags is None:
            return
        edit = edit_between(file_flags, flags)
        if edit["set"] or edit["remove"]:
            self._edits[name] = {"spec_flags": file_flags, **edit}
            self._write()
        else:
            self._drop(name)

    def _drop(self, name: str) -> None:
        if self._edits.pop(name, None) is not None:
            self._write()

    def _write(self) -> None:
        tmp = f"{self.path}.tmp"
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(self._edits, f, indent=1)
        os.replace(tmp, self.path)
