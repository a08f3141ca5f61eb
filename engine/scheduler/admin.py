"""How the scheduler carries out the admin messages of ``engine.scheduler.messages`` (on its thread)."""

from __future__ import annotations

from engine.scheduler import costs_probe
from engine.scheduler.messages import (
    AdminMsg,
    AttachStorage,
    DetachStorage,
    FinishProbe,
    FlushCache,
    NotIdleError,
    PauseStorage,
    ProbeCosts,
    ReadStorage,
    RequireIdle,
    ResumeStorage,
    SnapshotKVEvents,
    SwitchRole,
    UpdatePolicies,
)

_IO_NAMES = {
    "writes": "L1->L2 write(s)",
    "loads": "L2->L1 load(s)",
    "prefetches": "L3 prefetch(es)",
    "backups": "L2->L3 backup(s)",
}


def handle(sched, msg: AdminMsg) -> object:
    """Carry out ``msg`` on ``sched`` and return its result (see each message's docstring).

    Raises ``NotIdleError`` for an *idle* message while busy, ``CacheAdminError`` / ``ValueError`` when the
    cache refuses, ``TypeError`` for an object that is no admin message.
    """
    cache = sched.cache
    match msg:
        case FlushCache():
            sched.require_idle("flush cache")
            cache.reset()
            return None
        case RequireIdle(action=action):
            sched.require_idle(action)
            return None
        case SwitchRole(new_role=role, make_transfer=make_transfer):
            switch_role(sched, role, make_transfer)
            return None
        case AttachStorage():
            _require_idle_for_storage(sched, "attach")
            message = cache.storage.attach(
                msg.backend,
                msg.extra_config,
                prefetch_policy=msg.prefetch_policy,
                write_policy=msg.write_policy,
            )
            return message, cache.storage.backend_status()
        case DetachStorage():
            _require_idle_for_storage(sched, "detach")
            return cache.storage.take()
        case PauseStorage():
            _require_idle_for_storage(sched, "clear")
            return cache.storage.pause()
        case ResumeStorage(paused=paused):
            return cache.storage.resume(paused)
        case UpdatePolicies(fields=fields):
            _require_idle_for_storage(sched, "config update")
            return cache.update_policies(**fields)
        case SnapshotKVEvents():
            tree = cache.tree
            return (tree.events.seal() if tree.events is not None else 0), tree.residency_events()
        case ProbeCosts(sizes=sizes):
            return costs_probe.start(sched, sizes)
        case FinishProbe():
            costs_probe.finish(sched)
            return None
        case ReadStorage(what="backend"):
            return cache.storage.backend_status()
        case ReadStorage(what="config"):
            return cache.storage_status()
    raise TypeError(f"not an admin message: {msg!r}")


def _require_idle_for_storage(sched, action: str) -> None:
    """``require_idle``; a refusal while only cache I/O is in flight names that I/O instead ("it finishes on
    its own, retry in a moment"), so a caller can tell that from serving requests."""
    try:
        sched.require_idle(action)
    except NotIdleError:
        io = {k: v for k, v in sched.cache.inflight_io().items() if v}
        if sched.num_requests() or not io:
            raise
        named = ", ".join(f"{n} {_IO_NAMES.get(k, k)}" for k, n in io.items())
        raise NotIdleError(
            f"Reject {action}: not idle: no request running or waiting, only cache I/O in flight: "
            f"{named}; it finishes on its own, retry in a moment"
        ) from None


def switch_role(sched, new_role: str, make_transfer) -> None:
    """Flip an idle PD worker to ``new_role`` (``prefill`` / ``decode``).

    After upstream's ``--enable-pd-role-switch``: refuse unless fully idle (``NotIdleError``, nothing
    changed); then tear down the transport (threads, sockets, registered memory; the KV pool and weights
    stay), release the prefix cache (L1 and L2; L3 keeps its pages), and build the new role's transport with
    ``make_transfer(new_role)``. An error from here on propagates with the worker left without a transport:
    the caller marks it unhealthy (no rollback, as upstream). A new decode is told the bootstrap port it
    served as a prefill, so a request the router sent here as its prefill fails at once.

    At tp > 1 every rank runs this at the same point: the idle check agrees across the ranks, each rank
    rebuilds its own transport (``make_transfer`` of its pool; rank 0 first, as at start-up), and the ranks
    then agree that all of them succeeded, so one rank's failure fails the switch on every rank.
    """
    sched.require_idle("PD role switch")
    old = sched.pd.mgr.bootstrap_port if sched.pd.sends_kv else None
    sched.detach_pd()
    sched.cache.reset()
    if sched.tp is None:
        mgr = make_transfer(new_role)
    else:
        mgr = _make_transfer_on_every_rank(sched.tp.group, make_transfer, new_role)
    if new_role == "decode" and old is not None:
        mgr.former_bootstrap_port = old
    sched.attach_pd(new_role, mgr)


def _make_transfer_on_every_rank(group, make_transfer, new_role: str):
    """This rank's new transport, once every rank has built its own; else every rank raises (this rank's
    error, or one naming the rank that failed) with none left open."""
    mgr, error = None, None
    try:
        mgr = make_transfer(new_role)
    except Exception as exc:
        error = exc
    ok = group.all_min([int(error is None), group.rank if error is not None else group.size])
    if ok[0]:
        return mgr
    if mgr is not None:
        mgr.close()
    if error is not None:
        raise error
    raise RuntimeError(
        f"tensor-parallel rank {ok[1]} failed to build its {new_role} transport (its log says why)"
    )
