"""The typed messages other threads put into the scheduler's inbox, besides new requests.

``AbortReq`` ends one request. The admin messages change or read the cache or the PD role between
iterations; the scheduler answers each through the ``concurrent.futures.Future`` that ``Scheduler.post``
returns (its result, or the exception it raised). Messages marked *idle* are refused with ``NotIdleError``
unless the scheduler is idle (nothing running, waiting, in a PD queue or accepted by the HTTP server, no
cache I/O in flight); nothing changes then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal


class NotIdleError(RuntimeError):
    """An operation that needs an idle scheduler was refused; the message carries the queue counts."""


@dataclass(frozen=True)
class AbortReq:
    """Abort request ``rid`` (its client went away); an unknown or finished id is ignored."""

    rid: str


@dataclass(frozen=True)
class FlushCache:
    """*Idle*: drop every L1 and L2 entry of the prefix cache (L3 keeps its pages). Result: None."""


@dataclass(frozen=True)
class RequireIdle:
    """Raise ``NotIdleError`` naming ``action`` unless idle (``Scheduler.require_idle``); changes nothing.
    Result: None. The DP-attention flush asks every rank this before any rank drops its cache."""

    action: str


@dataclass(frozen=True)
class SwitchRole:
    """*Idle*: flip a PD worker to ``new_role`` (``prefill`` / ``decode``); ``make_transfer(role)`` builds
    the new role's KV transfer manager. Result: None. After ``NotIdleError`` nothing changed; any other
    error leaves the worker without a transport (see ``engine.scheduler.pd.switch_role``)."""

    new_role: Literal["prefill", "decode"]
    make_transfer: Callable | None = field(compare=False)  # None only on its way to the other TP ranks


@dataclass(frozen=True)
class AttachStorage:
    """*Idle* (``attach``): attach an L3 backend (a name, or one prepared off the scheduler thread) with the
    given policies. Result: ``(message | None, cache.storage.backend_status())``."""

    backend: object
    extra_config: str | None = None
    prefetch_policy: str | None = None
    write_policy: str | None = None


@dataclass(frozen=True)
class DetachStorage:
    """*Idle* (``detach``): take the L3 backend out of the cache. Result: the backend (to close off the
    scheduler thread) or None."""


@dataclass(frozen=True)
class PauseStorage:
    """*Idle* (``clear``): pause L3 I/O so the store can be wiped off the scheduler thread. Result: the
    paused backend, to hand back with ``ResumeStorage``."""


@dataclass(frozen=True)
class ResumeStorage:
    """Resume L3 I/O after ``PauseStorage``. Result: None."""

    paused: object


@dataclass(frozen=True)
class UpdatePolicies:
    """*Idle* (``config update``): change prefetch / write policies and thresholds (``HiRadixCache
    .update_policies`` keywords). Result: the new ``storage_status()``."""

    fields: dict


@dataclass(frozen=True)
class ReadStorage:
    """Read the live L3 state: ``backend`` (``cache.storage.backend_status()``) or ``config``
    (``storage_status()``)."""

    what: Literal["backend", "config"]


@dataclass(frozen=True)
class SnapshotKVEvents:
    """Seal the cache's KV event log (``HiRadixTree.events``) and list the ``Stored`` events that rebuild
    what the tree holds now (``HiRadixTree.residency_events``), both at one point of the scheduler thread.
    Result: ``(sequence, events)``, the last sealed batch's number (0 without a log) and the events."""


@dataclass(frozen=True)
class ProbeCosts:
    """*Idle* (``cost probe``): measure prefill, L2 -> L1 load-back and (L3 attached) L3 -> L2 prefetch at
    each of ``sizes`` (tokens; None: the default sizes) on scratch slots
    (``engine.scheduler.costs_probe.start``). Result: a ``costs_probe.ProbeStarted``. ``ValueError`` names
    ``sizes`` when they do not fit."""

    sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class FinishProbe:
    """After a probe's L3 round trips: process the cache's I/O events until none is in flight, so the
    probe's host slots are free again. Result: None."""


AdminMsg = (
    FlushCache
    | RequireIdle
    | SnapshotKVEvents
    | SwitchRole
    | AttachStorage
    | DetachStorage
    | PauseStorage
    | ResumeStorage
    | UpdatePolicies
    | ReadStorage
    | ProbeCosts
    | FinishProbe
)
