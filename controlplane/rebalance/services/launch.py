"""Creating a rebalance (live roles, plan, canary text, audit) and the operator's approve / pause / resume /
abort, each audited with before/after."""

from django.conf import settings
from django.db import IntegrityError, transaction

from controlplane.audit.services import audit_record
from controlplane.core.context import current_request_id
from controlplane.core.exceptions import ApplicationError, ConflictError, ServiceUnavailable
from controlplane.inventory.models import Router, RouterMode
from controlplane.rebalance.models import ACTIVE_STATES, REBALANCE_MACHINE, Approval, Rebalance, RebalanceStep
from controlplane.rebalance.models import RebalanceState as R
from controlplane.rebalance.models import StepState as S
from controlplane.rebalance.services import canary, pd
from controlplane.rebalance.services.plan import plan_steps
from controlplane.rebalance.services.transitions import enqueue_advance, rebalance_transition, step_transition
from controlplane.workerclient import RouterClient, WorkerError


def _active(router: Router) -> Rebalance | None:
    return Rebalance.objects.filter(router=router, state__in=ACTIVE_STATES).first()


def _conflict(active: Rebalance) -> ConflictError:
    return ConflictError(
        f"router already has rebalance {active.pk} ({active.state}); one at a time per router",
        code="rebalance_active",
        detail={"router": [f"rebalance {active.pk} is {active.state}"], "rebalance": active.pk},
    )


def _live_fleet(router: Router) -> tuple[list[tuple[object, str, int]], dict, int]:
    """(worker, live role, requests running, waiting or in PD transfer) per worker of the router, how each
    one's role can change (worker -> "switch" | "restart" | None, :func:`pd.switch_method`), and the largest
    KV page size (tokens) they report; the router must list each one with that role as its worker_type
    (actual = expected before anything moves)."""
    workers = list(router.workers.order_by("name"))
    if not workers:
        raise ApplicationError(
            f"router: {router.name} has no workers in the inventory",
            code="no_workers",
            detail={"router": ["no workers"]},
        )
    try:
        listed = {str(e.get("url", "")).rstrip("/"): e for e in RouterClient(router.url).list_workers()}
    except WorkerError as exc:
        raise ServiceUnavailable(
            f"router {router.name} unreachable: {exc.message}", code="router_unreachable"
        ) from exc
    live, mismatched, methods, page_size = [], [], {}, 1
    for worker in workers:
        try:
            state = pd.live_state(worker)
        except WorkerError as exc:
            raise ServiceUnavailable(
                f"worker {worker.name} unreachable, its live role is unknown: {exc.message}",
                code="worker_unreachable",
                detail={"worker": worker.name},
            ) from exc
        entry = listed.get(worker.router_url)
        if entry is None or entry.get("worker_type") != state["role"]:
            seen = "not listed" if entry is None else f"listed as {entry.get('worker_type')}"
            mismatched.append(f"{worker.name} runs {state['role']}, router: {seen}")
        load = sum(state[k] or 0 for k in ("num_running_reqs", "num_waiting_reqs", "num_pd_transfer_reqs"))
        live.append((worker, state["role"], load))
        methods[worker] = pd.switch_method(worker, state)
        page_size = max(page_size, state["page_size"] or 1)
    if mismatched:
        raise ConflictError(
            f"router {router.name} and its workers disagree: {'; '.join(mismatched)}",
            code="fleet_inconsistent",
            detail={"router": mismatched},
        )
    return live, methods, page_size


def router_slo(router: Router) -> dict:
    """The soak's SLO when the POST leaves `slo` out: the router pools' SLOs (TTFT p90 of the prefill pool,
    ITL p90 of the decode pool), the same ones the planner plans for; null thresholds are not watched."""
    return {"max_ttft_s": router.slo_ttft_p90_s, "max_itl_s": router.slo_itl_p90_s}


def rebalance_create(
    *,
    router: Router,
    target: dict,
    actor,
    approval: str = Approval.AUTO,
    reason: str = "",
    rollback: bool = True,
    soak_s: float | None = None,
    idle_timeout_s: float | None = None,
    slo: dict | None = None,
) -> Rebalance:
    """Plan a rebalance of `router` to `target` {"prefill", "decode"} from its workers' live roles, record
    the canaries' greedy texts through the router (:mod:`canary`), and start it (auto) or wait for
    approval (per_step).

    Each step changes its worker's role in place (/pd_role_switch) when the worker runs with
    --enable-pd-role-switch, else through its agent (a restart in the new role).

    Raises ApplicationError (400, naming the field: ``validation_error`` with ``detail.router`` for a
    non-PD router; 409 ``not_pd`` is only a GET of a PD-only resource of such a router) for a bad target,
    or a worker that must move but can do neither (`cannot_switch`, naming it), ConflictError (409)
    when the router has an active rebalance (`rebalance_active`) or the router's worker list disagrees with
    the workers' live roles (`fleet_inconsistent`), ServiceUnavailable (503) when the router or a worker
    does not answer."""
    if router.mode != RouterMode.PD:
        raise ApplicationError(
            f"router: {router.name} is not a PD router (mode {router.mode})",
            code="validation_error",
            detail={"router": [f"not a PD router (mode {router.mode})"]},
        )
    if (active := _active(router)) is not None:
        raise _conflict(active)
    live, methods, page_size = _live_fleet(router)
    planned = plan_steps(live, target, methods, pd.cannot_switch_reason)
    recorded = canary.record(router, page_size)
    before = {role: sum(1 for _, r, _ in live if r == role) for role in ("prefill", "decode")}
    user = actor if getattr(actor, "is_authenticated", False) else None
    try:
        with transaction.atomic():
            rb = Rebalance.objects.create(
                router=router,
                before_prefill=before["prefill"],
                before_decode=before["decode"],
                target_prefill=target["prefill"],
                target_decode=target["decode"],
                approval=approval,
                rollback=rollback,
                soak_s=settings.REBALANCE_SOAK_S if soak_s is None else soak_s,
                idle_timeout_s=settings.REBALANCE_IDLE_TIMEOUT_S
                if idle_timeout_s is None
                else idle_timeout_s,
                slo=slo if slo is not None else router_slo(router),
                canary=recorded,
                reason=reason,
                created_by=user,
                request_id=current_request_id(),
            )
            RebalanceStep.objects.bulk_create(
                [
                    RebalanceStep(
                        rebalance=rb,
                        index=i,
                        worker=s.worker,
                        from_role=s.from_role,
                        to_role=s.to_role,
                        method=s.method,
                    )
                    for i, s in enumerate(planned)
                ]
            )
            audit_record(
                action="rebalance_create",
                obj=rb,
                before={**before, "roles": {str(w): role for w, role, _ in live}},
                after={
                    **target,
                    "steps": [f"{s.worker}: {s.from_role} -> {s.to_role} ({s.method})" for s in planned],
                },
                message=reason,
                actor=actor,
                extra={"rebalance_id": rb.pk, "approval": approval, "canary": recorded},
            )
            if approval == Approval.PER_STEP:
                rebalance_transition(rb, to=R.AWAITING_APPROVAL, explanation="step 0 waits for approval")
            else:
                rebalance_transition(rb, to=R.RUNNING, explanation="running")
                enqueue_advance(rb.pk)
    except IntegrityError as exc:
        raise _conflict(_active(router) or rb) from exc
    return rb


def _audit_action(rb: Rebalance, action: str, actor, reason: str, before: dict) -> None:
    audit_record(
        action=f"rebalance_{action}",
        obj=rb,
        before=before,
        after={
            "state": rb.state,
            "pause_requested": rb.pause_requested,
            "abort_requested": rb.abort_requested,
            "approved_steps": rb.approved_steps,
        },  # fmt: skip
        message=reason,
        actor=actor,
        extra={"rebalance_id": rb.pk},
    )


def _snapshot(rb: Rebalance) -> dict:
    return {"state": rb.state, "pause_requested": rb.pause_requested, "abort_requested": rb.abort_requested,
            "approved_steps": rb.approved_steps}  # fmt: skip


def _locked(rb: Rebalance) -> Rebalance:
    return Rebalance.objects.select_for_update().select_related("router").get(pk=rb.pk)


def _require(rb: Rebalance, action: str) -> None:
    """Raises ConflictError (code cannot_<action>) unless REBALANCE_MACHINE allows `action` now."""
    if not REBALANCE_MACHINE.allows(rb, action):
        raise ConflictError(f"rebalance {rb.pk} is {rb.state}: cannot {action}", code=f"cannot_{action}")


def rebalance_approve(*, rb: Rebalance, actor, reason: str = "") -> Rebalance:
    """per_step: run the step that waits for approval. Raises ConflictError unless awaiting_approval."""
    with transaction.atomic():
        rb = _locked(rb)
        _require(rb, "approve")
        before = _snapshot(rb)
        nxt = rb.steps.filter(state=S.PENDING).order_by("index").first()
        approved = nxt.index + 1 if nxt is not None else rb.approved_steps
        rebalance_transition(
            rb, to=R.RUNNING, approved_steps=approved, explanation=f"step {approved} approved; running"
        )
        _audit_action(rb, "approve", actor, reason, before)
        enqueue_advance(rb.pk)
    return rb


def rebalance_pause(*, rb: Rebalance, actor, reason: str = "") -> Rebalance:
    """Stop before the next step (the current one finishes). Raises ConflictError unless running or
    awaiting approval."""
    with transaction.atomic():
        rb = _locked(rb)
        _require(rb, "pause")
        before = _snapshot(rb)
        if rb.state == R.AWAITING_APPROVAL:
            rebalance_transition(rb, to=R.PAUSED, explanation="paused while waiting for approval")
        else:  # running: the step runner pauses before the next step
            Rebalance.objects.filter(pk=rb.pk).update(pause_requested=True)
            rb.pause_requested = True
        _audit_action(rb, "pause", actor, reason, before)
    return rb


def rebalance_resume(*, rb: Rebalance, actor, reason: str = "") -> Rebalance:
    """Continue a paused rebalance (per_step: the next step still waits for approval), or withdraw a pause
    not yet taken. Raises ConflictError otherwise."""
    with transaction.atomic():
        rb = _locked(rb)
        _require(rb, "resume")
        before = _snapshot(rb)
        if rb.state == R.PAUSED:
            rebalance_transition(rb, to=R.RUNNING, explanation="resumed")
            enqueue_advance(rb.pk)
        else:  # running with a pause not yet taken: withdraw it
            Rebalance.objects.filter(pk=rb.pk).update(pause_requested=False)
            rb.pause_requested = False
        _audit_action(rb, "resume", actor, reason, before)
    return rb


def rebalance_abort(*, rb: Rebalance, actor, reason: str = "") -> Rebalance:
    """Stop at the current step's safe point: a step not yet switched goes back to the router in its old
    role; a switched one finishes its gates and soak (or rolls itself back). Finished steps are kept, so
    every worker ends in the router in its verified role. A rollback in progress cannot be aborted.
    Raises ConflictError when the rebalance has ended or is rolling back."""
    with transaction.atomic():
        rb = _locked(rb)
        _require(rb, "abort")
        before = _snapshot(rb)
        if rb.state != R.RUNNING:  # between steps: stop now
            for step in rb.steps.filter(state=S.PENDING):
                step.rebalance = rb
                step_transition(step, to=S.CANCELLED, explanation="not run: the rebalance was aborted")
            done = rb.steps.filter(state=S.SUCCEEDED).count()
            rebalance_transition(
                rb, to=R.ABORTED, abort_requested=True, explanation=f"aborted between steps ({done} done)"
            )
        else:  # the step runner stops at the current step's safe point
            Rebalance.objects.filter(pk=rb.pk).update(abort_requested=True)
            rb.abort_requested = True
        _audit_action(rb, "abort", actor, reason, before)
    return rb
