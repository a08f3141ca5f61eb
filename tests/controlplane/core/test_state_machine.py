"""The one state-machine primitive: the sets derived from each table, the rebalance's allowed actions (the
API's list is exactly what its action endpoints accept), and the sets rendered into the console's pages."""

import json
import re

import pytest
from cp_factories import EngineWorkerFactory, RouterFactory
from django.db import models

from controlplane.core.state_machine import InvalidTransition, StateMachine
from controlplane.operations.models import TARGET_MACHINE, OperationTarget
from controlplane.rebalance.models import REBALANCE_MACHINE, STEP_MACHINE, Rebalance, RebalanceState


class Light(models.TextChoices):
    RED = "red"
    GREEN = "green"
    OFF = "off"


def test_final_states_are_those_the_table_has_no_way_out_of():
    machine = StateMachine(
        name="light",
        states=Light,
        transitions={"red": frozenset({"green", "off"}), "green": frozenset({"red", "off"})},
        active=frozenset({"green"}),
        outcome=frozenset({"off"}),
    )
    assert machine.final == {"off"}
    assert machine.can_move("red", "green") and not machine.can_move("off", "red")
    assert machine.console_constants() == {
        "states": ["red", "green", "off"],
        "active": ["green"],
        "final": ["off"],
        "outcome": ["off"],
    }


@pytest.mark.parametrize(
    ("transitions", "active", "error"),
    [
        ({"red": frozenset({"blue"})}, frozenset(), "unknown states ['blue']"),
        ({"red": frozenset({"off"})}, frozenset({"off"}), "active and final overlap: ['off']"),
    ],
)
def test_a_table_naming_an_unknown_state_or_an_active_final_state_is_refused(transitions, active, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        StateMachine(name="light", states=Light, transitions=transitions, active=active, outcome=frozenset())


def test_the_real_machines_final_sets():
    assert TARGET_MACHINE.final == {"reverted", "revert_failed", "cancelled"}
    assert REBALANCE_MACHINE.final == {"succeeded", "rolled_back", "failed", "aborted"}
    assert STEP_MACHINE.final == {"failed", "rolled_back", "rollback_failed", "cancelled"}


def test_the_one_active_row_constraints_take_the_machines_active_sets():
    for model, machine in ((OperationTarget, TARGET_MACHINE), (Rebalance, REBALANCE_MACHINE)):
        (constraint,) = [c for c in model._meta.constraints if c.condition is not None]
        assert constraint.condition == machine.active_q()


@pytest.mark.django_db
def test_a_move_the_table_has_no_row_for_is_refused_and_changes_nothing():
    rb = _rebalance("planned")
    from controlplane.rebalance.services.transitions import rebalance_transition

    with pytest.raises(InvalidTransition, match="planned -> succeeded is not allowed"):
        rebalance_transition(rb, to="succeeded")
    rb.refresh_from_db()
    assert (rb.state, rb.version, rb.finished_at) == ("planned", 0, None)


def _rebalance(state: str, **flags) -> Rebalance:
    router = RouterFactory(mode="pd")
    EngineWorkerFactory(router=router, role="prefill")
    return Rebalance.objects.create(
        router=router, before_prefill=2, before_decode=1, target_prefill=1, target_decode=2, soak_s=5,
        idle_timeout_s=60, state=state, **flags,
    )  # fmt: skip


FLAGS = [{}, {"pause_requested": True}, {"abort_requested": True}]


@pytest.mark.django_db
@pytest.mark.parametrize("state", RebalanceState.values)
def test_allowed_actions_are_exactly_the_actions_the_api_accepts(api_as, state):
    operator = api_as("operator")
    for flags in FLAGS:
        listed = operator.get(f"/api/v1/rebalances/{_rebalance(state, **flags).pk}/").json()[
            "allowed_actions"
        ]
        accepted = []
        for action in ("approve", "pause", "resume", "abort"):
            rb = _rebalance(state, **flags)
            response = operator.post(f"/api/v1/rebalances/{rb.pk}/{action}/", {}, format="json")
            assert response.status_code in (200, 202, 409), (action, response.content)
            if response.status_code == 409:
                assert response.json()["error"]["code"] == f"cannot_{action}"
            else:
                accepted.append(action)
        assert listed == accepted, (state, flags)


@pytest.mark.django_db
def test_pages_get_the_state_sets_from_the_server(client, personas):
    client.force_login(personas["viewer"][0])
    page = client.get("/operations/1/").content.decode()
    script = re.search(r'<script id="state-machines" type="application/json">(.*?)</script>', page)
    machines = json.loads(script.group(1))
    assert machines["target"]["active"] == [
        "pending",
        "waiting_for_idle",
        "applying",
        "verifying",
        "reverting",
    ]
    assert machines["rebalance"]["final"] == ["succeeded", "rolled_back", "failed", "aborted"]
    assert machines["step"]["switched"] == ["gating", "soaking", "succeeded"]


@pytest.mark.django_db
def test_of_two_writers_from_the_same_state_only_the_first_moves_and_audits():
    from controlplane.audit.models import AuditEvent
    from controlplane.rebalance.services.transitions import rebalance_transition

    first = _rebalance("running")
    stale = Rebalance.objects.get(pk=first.pk)
    assert rebalance_transition(first, to="succeeded") is True
    assert rebalance_transition(stale, to="aborted") is False  # still expects running: nothing written
    first.refresh_from_db()
    assert (first.state, first.version) == ("succeeded", 1) and first.finished_at is not None
    assert list(
        AuditEvent.objects.filter(action="rebalance_finished").values_list("after__state", flat=True)
    ) == ["succeeded"]
