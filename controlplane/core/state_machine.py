"""One state-machine primitive for the control plane's long-running objects (operation targets, rebalances,
rebalance steps): the transition table, the state sets derived from it, and the one compare-and-set writer.

A `StateMachine` is declared once per model, next to the model. Everything else reads it:
- services move a row only through `StateMachine.transition` (compare-and-set on the expected state);
- the partial unique constraints take their condition from `active_q()` (the migration literal is its value);
- `allowed_actions(obj)` answers which operator actions (approve, pause, cancel, ...) the object takes now,
  for the services that guard them and for the API that tells the console which buttons to show;
- the console's pages get the sets from `console_constants()`, rendered into the page by the server.

Sets: `final` (no way out: derived, the states the table has no row for), `active` (in progress: declared,
because a machine may have states that are neither, such as a step not started yet or an operation target
that succeeded but may still be reverted), `outcome` (a move into one of these is audited: declared).
"""

from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field

from django.db import models, transaction
from django.db.models import F, Q
from django.utils import timezone

from controlplane.core.broadcast import emit_on_commit
from controlplane.core.exceptions import ApplicationError

# (group, event type, data) pushed on the websocket after a move commits; the object's new version is `seq`.
Event = tuple[str, str, dict]


class InvalidTransition(ApplicationError):
    code = "invalid_transition"


@dataclass(frozen=True)
class StateMachine:
    """The transition table of one model's `state` field.

    `states`: the model's TextChoices (their order is the order of every list this produces);
    `transitions`: state -> the states it may move to; `active`, `outcome`: see the module docstring;
    `actions`: operator action name -> a rule taking the (locked) object, True when the action is allowed now;
    `groups`: further named sets the console needs (e.g. the step states whose worker runs its new role).
    Raises ValueError at import when the table names an unknown state or `active` meets `final`.
    """

    name: str
    states: type[models.TextChoices]
    transitions: Mapping[str, frozenset[str]]
    active: frozenset[str]
    outcome: frozenset[str]
    actions: Mapping[str, Callable[[object], bool]] = field(default_factory=dict)
    groups: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        known = set(self.states.values)
        used = set(self.transitions) | {s for targets in self.transitions.values() for s in targets}
        unknown = (used | self.active | self.outcome | set().union(*self.groups.values())) - known
        if unknown:
            raise ValueError(f"{self.name}: unknown states {sorted(unknown)}")
        if self.active & self.final:
            raise ValueError(f"{self.name}: active and final overlap: {sorted(self.active & self.final)}")

    @property
    def final(self) -> frozenset[str]:
        """States with no way out (the table has no move from them)."""
        return frozenset(s for s in self.states.values if not self.transitions.get(s))

    def ordered(self, states: Iterable[str]) -> list[str]:
        """`states` as a list in the choices' order (stable: migrations and pages compare it)."""
        wanted = set(states)
        return [s for s in self.states.values if s in wanted]

    def active_q(self, field_name: str = "state") -> Q:
        """The condition "in an active state", for querysets and partial unique constraints."""
        return Q(**{f"{field_name}__in": self.ordered(self.active)})

    def can_move(self, expected: str, to: str) -> bool:
        return to in self.transitions.get(expected, frozenset())

    def allowed_actions(self, obj) -> list[str]:
        """The operator actions `obj` takes in its current state, in declaration order."""
        return [name for name, rule in self.actions.items() if rule(obj)]

    def allows(self, obj, action: str) -> bool:
        """Raises KeyError for an action this machine does not declare."""
        return self.actions[action](obj)

    def console_constants(self) -> dict:
        """The sets the console's pages need, as JSON-ready lists."""
        return {
            "states": list(self.states.values),
            "active": self.ordered(self.active),
            "final": self.ordered(self.final),
            "outcome": self.ordered(self.outcome),
            **{name: self.ordered(states) for name, states in self.groups.items()},
        }

    def transition(
        self,
        obj: models.Model,
        *,
        to: str,
        changes: dict,
        atomic: bool,
        audit: Callable[[str], None] | None = None,
        events: Callable[[str], list[Event]] = lambda expected: [],
    ) -> bool:
        """Move `obj` from its current (expected) `state` to `to` with one conditional UPDATE; False when
        another writer moved it first (nothing written, nothing sent).

        The UPDATE also writes `changes`, `updated_at`, `finished_at` (on a move into a final or outcome
        state) and `version + 1`; `obj` is updated in memory to match. On success `audit(expected)` runs in
        the same transaction (`atomic=True` opens one; a lone UPDATE needs none) and each of
        `events(expected)` is sent once the transaction commits, with `seq` = the new version.
        Raises InvalidTransition when the table has no move from the expected state to `to`.
        """
        expected = obj.state
        if not self.can_move(expected, to):
            raise InvalidTransition(f"{self.name} {obj.pk}: {expected} -> {to} is not allowed")
        now = timezone.now()
        changes = {"state": to, "updated_at": now, **changes}
        if to in self.final or to in self.outcome:
            changes["finished_at"] = now
        with transaction.atomic() if atomic else nullcontext():
            moved = (
                type(obj)
                ._default_manager.filter(pk=obj.pk, state=expected)
                .update(version=F("version") + 1, **changes)
            )
            if not moved:
                return False
            for key, value in changes.items():
                setattr(obj, key, value)
            obj.version += 1
            if audit is not None:
                audit(expected)
            for group, event_type, data in events(expected):
                emit_on_commit(group, event_type, data, seq=obj.version)
        return True
