"""The plan of steps from live roles to a target (pure: no database, no HTTP).

Each step moves one worker from the donor role (the one that shrinks) to the receiver role, switched in
place (`/pd_role_switch`) or restarted in it by its agent, so the worker is out of both pools only while
it drains, flips and passes its gates. While step i runs, the donor pool has before - i workers (never
below the target, so never below min(before, after)) and the receiver pool still has its before count (the
smaller one); the receiver's new member joins before the next donor leaves. Every step keeps at least one
prefill and one decode routable.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from controlplane.core.exceptions import ApplicationError

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class PlannedStep:
    worker: object
    from_role: str
    to_role: str
    method: str = "switch"


def plan_steps(
    live: list[tuple[object, str, int]],
    target: dict[str, int],
    methods: dict | None = None,
    cannot: Callable[[Any], str] = str,
) -> list[PlannedStep]:
    """`live`: (worker, live role, load) per worker of the router; load orders the donors (the least loaded,
    i.e. fewest requests running, waiting or in PD transfer, is drained first; ties by name).
    `target`: {"prefill", "decode"}. `methods`: worker -> how its role can change ("switch" | "restart"),
    None when it cannot (default: every worker switches); donors that can move go first.
    `cannot(worker)`: the words for a donor that cannot move.

    Raises ApplicationError (400) naming the field: `target` with a count below 1, a total that differs from
    the router's PD workers (workers are moved, never added or removed), or the current split itself;
    `router` when a worker's live role is not prefill or decode, or when fewer donors than the moves can
    change role (`cannot_switch`, naming them).
    """
    odd = sorted(str(w) for w, role, _ in live if role not in ROLES)
    if odd:
        raise ApplicationError(
            f"router: workers not in PD mode (live role not prefill/decode): {', '.join(odd)}",
            code="validation_error",
            detail={"router": [f"not a PD worker: {name}" for name in odd]},
        )
    counts = {role: sum(1 for _, r, _ in live if r == role) for role in ROLES}
    for role in ROLES:
        if target[role] < 1:
            raise ApplicationError(
                f"target.{role} must be at least 1 (got {target[role]})",
                code="bad_target",
                detail={"target": {role: ["at least one worker of each role"]}},
            )
    if sum(target.values()) != sum(counts.values()):
        raise ApplicationError(
            f"target: {target['prefill']}P{target['decode']}D has {sum(target.values())} workers, the router "
            f"has {sum(counts.values())} ({counts['prefill']}P{counts['decode']}D); a rebalance moves "
            "workers between roles",
            code="bad_target",
            detail={"target": ["prefill + decode must equal the router's PD workers"]},
        )
    if target == counts:
        raise ApplicationError(
            f"target: the router already runs {counts['prefill']}P{counts['decode']}D",
            code="no_change",
            detail={"target": ["equals the current split"]},
        )
    donor = "prefill" if target["prefill"] < counts["prefill"] else "decode"
    receiver = "decode" if donor == "prefill" else "prefill"
    moves = counts[donor] - target[donor]
    method = (lambda w: "switch") if methods is None else methods.get
    donors = sorted(
        ((method(w) is None, load, str(w), w) for w, role, load in live if role == donor), key=lambda x: x[:3]
    )[:moves]
    stuck = [w for *_, w in donors if method(w) is None]
    if stuck:
        raise ApplicationError(
            f"router: {moves} {donor} worker(s) must change role, and {len(stuck)} of those it has cannot: "
            + "; ".join(cannot(w) for w in stuck),
            code="cannot_switch",
            detail={"router": [cannot(w) for w in stuck], "workers": [str(w) for w in stuck]},
        )
    return [
        PlannedStep(worker=w, from_role=donor, to_role=receiver, method=str(method(w))) for *_, w in donors
    ]
