"""Fast rebalance checks: the plan of steps, both transition tables, the API's refusals (no workers
contacted: each refusal comes before any HTTP call), and the restart of a lost task chain."""

from datetime import timedelta

import pytest
from cp_factories import EngineWorkerFactory, RouterFactory
from django.conf import settings
from django.utils import timezone

from controlplane.audit.models import AuditEvent
from controlplane.core.exceptions import ApplicationError
from controlplane.rebalance.models import (
    ACTIVE_STATES,
    FINAL_STATES,
    STEP_ACTIVE_STATES,
    STEP_FINAL_STATES,
    STEP_TRANSITIONS,
    TRANSITIONS,
    Rebalance,
    RebalanceState,
    RebalanceStep,
    StepState,
)
from controlplane.rebalance.services import canary, rebalance_advance, rebalance_resume_stalled
from controlplane.rebalance.services.plan import plan_steps


def _moves(live, target):
    return [(s.worker, s.from_role, s.to_role) for s in plan_steps(live, target)]


def test_donors_are_the_least_loaded_then_by_name_and_move_to_the_receiver_role():
    live = [("p-b", "prefill", 0), ("p-a", "prefill", 3), ("p-c", "prefill", 0), ("d-a", "decode", 0)]
    assert _moves(live, {"prefill": 2, "decode": 2}) == [("p-b", "prefill", "decode")]
    assert _moves(live, {"prefill": 1, "decode": 3}) == [
        ("p-b", "prefill", "decode"),
        ("p-c", "prefill", "decode"),
    ]
    live = [("d1", "decode", 1), ("d0", "decode", 1), ("p0", "prefill", 9)]
    assert _moves(live, {"prefill": 2, "decode": 1}) == [("d0", "decode", "prefill")]


def test_capacity_never_drops_below_the_smaller_of_before_and_after():
    live = [(f"p{i}", "prefill", 0) for i in range(4)] + [("d0", "decode", 0)]
    target = {"prefill": 1, "decode": 4}
    counts = {"prefill": 4, "decode": 1}
    for step in plan_steps(live, target):
        counts[step.from_role] -= 1  # out of both pools while it drains, switches and passes its gates
        assert counts["prefill"] >= min(4, 1) and counts["decode"] >= min(1, 4)
        assert counts["prefill"] >= 1 and counts["decode"] >= 1
        counts[step.to_role] += 1
    assert counts == target


@pytest.mark.parametrize(
    ("target", "field", "words"),
    [
        ({"prefill": 0, "decode": 3}, "target", "at least 1"),
        ({"prefill": 2, "decode": 2}, "target", "has 4 workers, the router has 3"),
        ({"prefill": 2, "decode": 1}, "target", "already runs 2P1D"),
    ],
)
def test_bad_targets_are_refused_naming_the_field(target, field, words):
    live = [("p0", "prefill", 0), ("p1", "prefill", 0), ("d0", "decode", 0)]
    with pytest.raises(ApplicationError) as err:
        plan_steps(live, target)
    assert field in err.value.detail and words in err.value.message


def test_a_worker_not_in_pd_mode_is_refused():
    with pytest.raises(ApplicationError) as err:
        plan_steps([("w0", "null", 0), ("d0", "decode", 0)], {"prefill": 1, "decode": 1})
    assert "router" in err.value.detail and "w0" in err.value.message


def test_donors_that_can_change_role_go_first_and_one_that_cannot_is_refused_by_name():
    """switch: --enable-pd-role-switch; restart: an agent runs it; None: neither (it cannot move)."""
    live = [("d0", "decode", 0), ("d1", "decode", 0), ("d2", "decode", 5), ("p0", "prefill", 0)]
    methods = {"d0": None, "d1": "restart", "d2": "switch", "p0": "switch"}
    steps = plan_steps(live, {"prefill": 3, "decode": 1}, methods)
    assert [(s.worker, s.method) for s in steps] == [("d1", "restart"), ("d2", "switch")]
    with pytest.raises(ApplicationError) as err:
        plan_steps(live, {"prefill": 3, "decode": 1}, {**methods, "d2": None}, lambda w: f"{w} cannot move")
    assert err.value.code == "cannot_switch" and err.value.detail["workers"] == ["d0"]
    assert err.value.status_code == 400 and "router" in err.value.detail
    assert "2 decode worker(s) must change role, and 1 of those it has cannot: d0 cannot move" in (
        err.value.message
    )


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
def test_the_canary_set_has_three_lengths_and_one_spans_more_than_two_pages(page_size):
    short, sentence, long = canary.prompts(page_size)
    assert len(short["text"]) < len(sentence["text"]) < len(long["text"])
    assert len(long["text"].split()) > 2 * page_size  # a word is at least one token
    assert {p["max_new_tokens"] for p in (short, sentence, long)} == {
        settings.REBALANCE_CANARY_MAX_NEW_TOKENS
    }


@pytest.mark.parametrize(
    ("table", "states", "active", "final", "start"),
    [
        (TRANSITIONS, RebalanceState, ACTIVE_STATES, FINAL_STATES, RebalanceState.PLANNED),
        (STEP_TRANSITIONS, StepState, STEP_ACTIVE_STATES, STEP_FINAL_STATES, StepState.PENDING),
    ],
)
def test_transition_tables_are_closed_and_every_state_is_reachable(table, states, active, final, start):
    assert set(table) | {t for targets in table.values() for t in targets} <= set(states)
    assert not any(table.get(s) for s in final)  # nothing leaves a final state
    assert not active & final
    seen, todo = {start}, [start]
    while todo:
        for nxt in table.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(states)


@pytest.mark.django_db
def test_api_refusals_name_the_field_and_a_second_rebalance_is_409(api_as):
    pd_router = RouterFactory(name="pd", mode="pd")
    regular = RouterFactory(name="plain")
    EngineWorkerFactory(router=pd_router, role="prefill")
    op = api_as("operator")

    def post(body):
        return op.post("/api/v1/rebalances/", body, format="json")

    bad = post({"router": pd_router.pk, "target": {"prefill": 0, "decode": 2}})
    assert bad.status_code == 400 and "target" in bad.json()["error"]["detail"]
    bad = post({"router": pd_router.pk, "target": {"prefill": 1, "decode": 2, "extra": 3}})
    assert bad.status_code == 400 and bad.json()["error"]["detail"] == {
        "target": {"extra": ["unknown field; known: decode, prefill"]}
    }
    bad = post({"router": pd_router.pk, "target": {"prefill": 1, "decode": 2}, "approval": "sometimes"})
    assert bad.status_code == 400 and "approval" in bad.json()["error"]["detail"]
    bad = post({"router": regular.pk, "target": {"prefill": 1, "decode": 1}})
    assert bad.status_code == 400 and "router" in bad.json()["error"]["detail"]
    active = Rebalance.objects.create(
        router=pd_router, before_prefill=2, before_decode=1, target_prefill=1, target_decode=2, soak_s=1,
        idle_timeout_s=1, state="running",
    )  # fmt: skip
    busy = post({"router": pd_router.pk, "target": {"prefill": 1, "decode": 2}})
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "rebalance_active"
    assert busy.json()["error"]["detail"]["rebalance"] == active.pk
    assert api_as("viewer").post(f"/api/v1/rebalances/{active.pk}/abort/").status_code == 403
    assert api_as("agent").post(f"/api/v1/rebalances/{active.pk}/abort/").status_code == 403
    assert op.post(f"/api/v1/rebalances/{active.pk}/approve/").status_code == 409  # not awaiting approval
    assert Rebalance.objects.count() == 1


@pytest.mark.django_db
def test_a_lost_task_chain_is_restarted_and_an_old_chain_stops():
    """A running rebalance whose last advance is older than REBALANCE_STALL_S gets a new chain (audited); a
    task of the old chain does nothing, the new one drives it (here: every step done, so it succeeds)."""
    router = RouterFactory(name="pd", mode="pd")
    worker = EngineWorkerFactory(router=router, role="decode")
    old = timezone.now() - timedelta(seconds=settings.REBALANCE_STALL_S + 5)
    rb = Rebalance.objects.create(
        router=router, before_prefill=2, before_decode=1, target_prefill=1, target_decode=2, soak_s=1,
        idle_timeout_s=1, state="running", chain="lost", advanced_at=old,
    )  # fmt: skip
    RebalanceStep.objects.create(
        rebalance=rb, index=0, worker=worker, from_role="prefill", to_role="decode", state="succeeded"
    )
    fresh = Rebalance.objects.create(
        router=RouterFactory(mode="pd"), before_prefill=2, before_decode=1, target_prefill=1, target_decode=2,
        soak_s=1, idle_timeout_s=1, state="running", chain="live", advanced_at=timezone.now(),
    )  # fmt: skip
    assert rebalance_resume_stalled() == 1
    rb.refresh_from_db()
    assert rb.chain not in ("", "lost") and Rebalance.objects.get(pk=fresh.pk).chain == "live"
    assert AuditEvent.objects.filter(action="rebalance_task_restarted", extra__rebalance_id=rb.pk).exists()
    assert rebalance_advance(rebalance_id=rb.pk, chain="lost") is None
    assert Rebalance.objects.get(pk=rb.pk).state == "running"
    assert rebalance_advance(rebalance_id=rb.pk, chain=rb.chain) is None
    rb.refresh_from_db()
    assert rb.state == "succeeded" and rb.explanation == "all 1 steps succeeded: now 1P2D"


@pytest.mark.django_db
def test_a_role_switch_record_shows_what_the_worker_is_not_its_load_and_names_its_rebalance():
    """The audit row of a finished step diffs role, bootstrap port, role switch, page size only (the load
    counters read at the same moments differ every time) and carries the rebalance and router it links to."""
    from controlplane.rebalance.services.transitions import step_transition

    router = RouterFactory(name="pd", mode="pd")
    worker = EngineWorkerFactory(router=router, role="decode")
    rb = Rebalance.objects.create(
        router=router, before_prefill=2, before_decode=1, target_prefill=1, target_decode=2, soak_s=1,
        idle_timeout_s=1, state="running",
    )  # fmt: skip
    load = {"is_idle": True, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_pd_transfer_reqs": 0}
    step = RebalanceStep.objects.create(
        rebalance=rb, index=1, worker=worker, from_role="prefill", to_role="decode", state="soaking",
        before={"role": "prefill", "bootstrap_port": 8998, "role_switch": True, "page_size": 16, **load,
                "is_idle": False, "num_running_reqs": 3, "num_http_reqs": 4},
        after={"role": "decode", "bootstrap_port": None, "role_switch": True, "page_size": 16, **load,
               "num_http_reqs": 0},
    )  # fmt: skip
    step_transition(step, to=StepState.SUCCEEDED, explanation="soaked")
    (record,) = AuditEvent.objects.filter(action="role_switch", extra__rebalance_id=rb.pk)
    assert record.changes == {"role": ["prefill", "decode"], "bootstrap_port": [8998, None]}
    assert (record.extra["router_id"], record.extra["step_index"]) == (router.pk, 1)
