"""The step runner: one advance of a rebalance per call (Celery task `rebalance.advance`), re-run with the
delay it returns until the rebalance waits (approval, pause) or ends.

A step (one worker, donor role -> receiver role): remove it from the router, wait until it is idle (the
router's DELETE is queued: first until the router no longer lists it, then until /server_info is_idle,
PD transfers included), switch it (`/pd_role_switch`; for an engine without --enable-pd-role-switch its
agent restarts it in the new role, `RebalanceStep.method`), read the role back from /server_info, gate it
(health, a new prefill's bootstrap server, a canary through the new pairing), re-add it to the router with
its type and bootstrap port, then soak (`soak_s`, health and SLOs watched). Failing before the switch took
effect leaves the old role (re-added: step failed); failing after it rolls the step back the same way
(drain, switch back or restart back by the same method, verify, gates without the canary, re-add). Then the
rebalance rolls back every finished step, newest first, unless `rollback` is false.
"""

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from controlplane.inventory.services import worker_role_observed
from controlplane.rebalance.models import FINAL_STATES, Approval, Rebalance, RebalanceStep, SwitchMethod
from controlplane.rebalance.models import RebalanceState as R
from controlplane.rebalance.models import StepState as S
from controlplane.rebalance.services import pd, slo
from controlplane.rebalance.services.transitions import live_counts, rebalance_transition, step_transition
from controlplane.telemetry import promql
from controlplane.telemetry.selectors import unavailable_text
from controlplane.workerclient import WorkerError, WorkerRejected

SOAK_POLL_S = 1.0
RESTART_POLL_S = 1.0  # how often a step looks whether the agent restarted its worker in the new role


def _poll() -> float:
    return settings.OPERATION_POLL_INTERVAL_S


def _now():
    return timezone.now()


def _split(counts: dict) -> str:
    return f"{counts['prefill']}P{counts['decode']}D"


def _steps(rb: Rebalance) -> list[RebalanceStep]:
    steps = list(rb.steps.select_related("worker").order_by("index"))
    for step in steps:
        step.rebalance = rb
    return steps


def rebalance_advance(*, rebalance_id: int, chain: str | None = None) -> float | None:
    """Advance the rebalance by one step action; the delay (s) before the next call, or None when it now
    waits for the API (approval, pause), has ended, or `chain` is not the task chain that drives it."""
    rb = Rebalance.objects.select_related("router", "created_by").filter(pk=rebalance_id).first()
    if rb is None or rb.state in FINAL_STATES or (chain is not None and rb.chain != chain):
        return None
    Rebalance.objects.filter(pk=rb.pk).update(advanced_at=_now())
    if rb.state == R.RUNNING:
        return _run(rb)
    if rb.state == R.ROLLING_BACK:
        return _roll_back(rb)
    return None


# --------------------------------------------------------------------------------------------- rebalance


def _run(rb: Rebalance) -> float | None:
    steps = _steps(rb)
    current = next((s for s in steps if s.state in RUNNERS), None)
    if current is not None:
        return RUNNERS[current.state](rb, current)
    failed = next((s for s in steps if s.state in (S.FAILED, S.ROLLED_BACK, S.ROLLBACK_FAILED)), None)
    if failed is not None:
        return _after_failure(rb, steps, failed)
    pending = [s for s in steps if s.state == S.PENDING]
    if rb.abort_requested:
        _cancel(pending, "not run: the rebalance was aborted")
        done = [s for s in steps if s.state == S.SUCCEEDED]
        rebalance_transition(
            rb,
            to=R.ABORTED,
            explanation=f"aborted: {len(done)} of {len(steps)} steps done, {len(pending)} not run; fleet at "
            f"{_split(live_counts(rb))}, every worker in the router in its verified role",
        )
        return None
    if not pending:
        rebalance_transition(
            rb, to=R.SUCCEEDED, explanation=f"all {len(steps)} steps succeeded: now {_split(live_counts(rb))}"
        )
        return None
    nxt = pending[0]
    if rb.pause_requested:
        rebalance_transition(
            rb, to=R.PAUSED, pause_requested=False, explanation=f"paused before step {nxt.number}"
        )
        return None
    if rb.approval == Approval.PER_STEP and nxt.index >= rb.approved_steps:
        rebalance_transition(
            rb,
            to=R.AWAITING_APPROVAL,
            explanation=f"step {nxt.number} ({nxt.worker.name}: {nxt.from_role} -> {nxt.to_role}) waits for "
            "approval",
        )
        return None
    return _start(rb, nxt)


def _cancel(steps: list[RebalanceStep], why: str) -> None:
    for step in steps:
        step_transition(step, to=S.CANCELLED, explanation=why)


def steps_text(numbers: list[int]) -> str:
    """Step numbers as a sentence's object: ``"step 2"``, ``"steps 2, 1"`` (in the order given)."""
    return ("step " if len(numbers) == 1 else "steps ") + ", ".join(str(n) for n in numbers)


def _after_failure(rb: Rebalance, steps: list[RebalanceStep], failed: RebalanceStep) -> float | None:
    _cancel([s for s in steps if s.state == S.PENDING], f"not run: step {failed.number} failed")
    done = [s.number for s in steps if s.state == S.SUCCEEDED]
    cause = f"step {failed.number} ({failed.worker.name}) {failed.state}: {failed.explanation}"
    if done and not rb.rollback:
        kept = steps_text(done)
        rebalance_transition(
            rb,
            to=R.FAILED,
            explanation=f"{cause}; rollback: false, left at {_split(live_counts(rb))} ({kept} kept)",
        )
        return None
    undo = f"rolling back {steps_text(sorted(done, reverse=True))}" if done else "nothing to roll back"
    rebalance_transition(rb, to=R.ROLLING_BACK, explanation=f"{cause}; {undo}")
    return 0


def _roll_back(rb: Rebalance) -> float | None:
    steps = _steps(rb)
    current = next((s for s in steps if s.state == S.ROLLING_BACK), None)
    if current is None:
        done = [s for s in steps if s.state == S.SUCCEEDED]
        if done:
            step = done[-1]
            why = f"the rebalance rolls back ({rb.explanation})"
            if step_transition(
                step,
                to=S.ROLLING_BACK,
                rollback_cause=why,
                explanation=f"rolling back: {why}",
                restart_requested_at=None,
                withdrawn_seq=None,
                **_deadline(rb),
            ):
                return _rollback_step(rb, step)
            return _poll()
        _finish_rollback(rb, steps)
        return None
    return _rollback_step(rb, current)


def _finish_rollback(rb: Rebalance, steps: list[RebalanceStep]) -> None:
    counts = _split(live_counts(rb))
    stuck = [s for s in steps if s.state == S.ROLLBACK_FAILED or (s.after or {}).get("unhealthy")]
    if stuck:
        names = ", ".join(f"{s.worker.name} ({s.explanation})" for s in stuck)
        rebalance_transition(rb, to=R.FAILED, explanation=f"{rb.explanation}; not restored: {names}")
        return None
    rebalance_transition(
        rb, to=R.ROLLED_BACK, explanation=f"{rb.explanation}; rolled back: fleet at {counts}"
    )
    return None


def _deadline(rb: Rebalance) -> dict:
    return {"idle_deadline_at": _now() + timedelta(seconds=rb.idle_timeout_s), "polls": 0}


# ------------------------------------------------------------------------------------------------- steps


def _fail(rb: Rebalance, step: RebalanceStep, why: str, *, readd: bool = True) -> float:
    """The step failed with the worker still in its old role: re-add it there (read live) and say so."""
    fields: dict = {}
    try:
        state = pd.live_state(step.worker)
        fields["after"] = state
        if readd:
            pd.router_add(rb, step.worker, state)
            why += f"; left as {state['role']}, re-added to the router"
            fields["drained"] = False
    except WorkerError as exc:
        why += f"; not re-added: {exc.message}"
    step_transition(step, to=S.FAILED, explanation=why, **fields)
    return 0


def _start(rb: Rebalance, step: RebalanceStep) -> float | None:
    worker = step.worker
    try:
        before = pd.live_state(worker)
    except WorkerError as exc:
        step_transition(
            step, to=S.FAILED, explanation=f"cannot read the worker: {exc.message}; nothing changed"
        )
        return 0
    if before["role"] != step.from_role:
        step_transition(
            step,
            to=S.FAILED,
            before=before,
            explanation=f"live role is {before['role']}, the plan expects {step.from_role}; nothing changed",
        )
        return 0
    try:
        pd.router_remove(rb, worker)
    except WorkerError as exc:
        step_transition(step, to=S.FAILED, before=before, explanation=f"router removal failed: {exc.message}")
        return 0
    step_transition(
        step,
        to=S.DRAINING,
        before=before,
        drained=True,
        explanation=f"removed from router {rb.router.name}; waiting for idle",
        **_deadline(rb),
    )
    return _drain(rb, step)


def _idle(rb: Rebalance, step: RebalanceStep) -> tuple[bool, str]:
    """(idle, what was seen): out of the router's list and /server_info is_idle (PD queues included)."""
    try:
        if pd.router_entry(rb, step.worker) is not None:
            return False, "router still lists it (removal queued)"
        state = pd.live_state(step.worker)
    except WorkerError as exc:
        return False, f"unreachable ({exc.message})"
    return state["is_idle"], pd.busy_summary(state)


def _drain(rb: Rebalance, step: RebalanceStep) -> float | None:
    if Rebalance.objects.filter(pk=rb.pk, abort_requested=True).exists():
        return _abort_step(rb, step)
    idle, seen = _idle(rb, step)
    if idle:
        step_transition(step, to=S.SWITCHING, explanation=f"idle; switching to {step.to_role}")
        return _switch(rb, step)
    if _now() >= step.idle_deadline_at:
        return _fail(rb, step, f"not idle within {rb.idle_timeout_s:g}s (last seen {seen}); not switched")
    RebalanceStep.objects.filter(pk=step.pk, state=S.DRAINING).update(
        polls=step.polls + 1, explanation=f"removed from router; waiting for idle: {seen}"
    )
    return _poll()


def _abort_step(rb: Rebalance, step: RebalanceStep) -> float:
    """Abort's safe point before the switch: the worker goes back to the router in its old role."""
    try:
        state = pd.live_state(step.worker)
        pd.router_add(rb, step.worker, state)
    except WorkerError as exc:
        return _fail(rb, step, f"aborted while draining; re-adding failed: {exc.message}", readd=False)
    step_transition(
        step,
        to=S.CANCELLED,
        after=state,
        drained=False,
        explanation=f"aborted while draining: not switched, re-added as {state['role']}",
    )
    return 0


def _to_rollback(rb: Rebalance, step: RebalanceStep, why: str, **fields) -> float:
    step_transition(
        step,
        to=S.ROLLING_BACK,
        rollback_cause=why,
        explanation=f"{why}; rolling back",
        restart_requested_at=None,
        withdrawn_seq=None,
        **fields,
        **_deadline(rb),
    )
    return 0


def _how(step: RebalanceStep) -> str:
    return "restarted by its agent" if step.method == SwitchMethod.RESTART else "switched in place"


def _switch(rb: Rebalance, step: RebalanceStep) -> float | None:
    worker = step.worker
    if step.method == SwitchMethod.RESTART:
        return _restart(rb, step)
    RebalanceStep.objects.filter(pk=step.pk).update(switch_sent=True)
    step.switch_sent = True
    try:
        answer = pd.client_for(worker, settings.WORKER_APPLY_HTTP_TIMEOUT_S).pd_role_switch(step.to_role)
    except WorkerRejected as exc:
        if exc.status == 400 and "disabled" in exc.message and pd.agent_managed(worker):
            RebalanceStep.objects.filter(pk=step.pk).update(method=SwitchMethod.RESTART)
            step.method = SwitchMethod.RESTART
            return _restart(rb, step, note=f"the engine cannot switch in place ({exc.message}); ")
        return _switch_unknown(rb, step, f"role switch request failed: {exc.message}")
    except WorkerError as exc:
        return _switch_unknown(rb, step, f"role switch request failed: {exc.message}")
    if not answer.success:
        if "not idle" in answer.message:
            step_transition(
                step, to=S.DRAINING, explanation=f"switch refused, waiting again: {answer.message}"
            )
            return _poll()
        if not answer.safe_to_restore:
            why = f"role switch failed, worker unhealthy: {answer.message}; left out of the router"
            step_transition(step, to=S.FAILED, after={"unhealthy": answer.message}, explanation=why)
            return 0
        return _fail(rb, step, f"role switch refused: {answer.message}")
    try:
        state = pd.live_state(worker)
    except WorkerError as exc:
        why = f"switched, but /server_info does not answer: {exc.message}"
        return _to_rollback(rb, step, why, switched_at=_now())
    if state["role"] != step.to_role:
        return _to_rollback(
            rb, step, f"switch answered success but /server_info reports role {state['role']}", after=state
        )
    step_transition(
        step,
        to=S.GATING,
        after=state,
        switched_at=_now(),
        explanation=f"switched to {step.to_role} (read back from /server_info); gating",
    )
    return _gate(rb, step)


def _restart(rb: Rebalance, step: RebalanceStep, note: str = "") -> float | None:
    """The switch by the worker's agent: ask it (the worker's desired_role) to restart the worker in the new
    role, then poll every RESTART_POLL_S until /server_info reports that role and /health answers, for at
    most REBALANCE_RESTART_TIMEOUT_S (past it the step rolls back); then gate as after a switch in place."""
    worker = step.worker
    if step.restart_requested_at is None:
        try:
            state = pd.live_state(worker)
        except WorkerError as exc:
            return _fail(
                rb, step, f"{note}worker unreadable before its restart: {exc.message}; not restarted"
            )
        seq = pd.request_restart(rb, worker, step.to_role, state["role"])
        now = _now()
        why = f"{note}asked its agent (host {worker.host.name}) to restart it as {step.to_role}; waiting"
        RebalanceStep.objects.filter(pk=step.pk, state=S.SWITCHING).update(
            switch_sent=True, restart_requested_at=now, restart_seq=seq, explanation=why
        )
        step.switch_sent, step.restart_requested_at, step.restart_seq = True, now, seq
        return RESTART_POLL_S
    restarted, seen = pd.restarted(worker, step.to_role)
    if restarted is not None:
        step_transition(
            step,
            to=S.GATING,
            after=restarted,
            switched_at=_now(),
            explanation=f"restarted by its agent as {step.to_role} (read back from /server_info, /health "
            "answers); gating",
        )
        return _gate(rb, step)
    limit = settings.REBALANCE_RESTART_TIMEOUT_S
    if _now() >= step.restart_requested_at + timedelta(seconds=limit):
        why = f"its agent did not restart it as {step.to_role} within {limit:g}s (last seen: {seen})"
        return _to_rollback(rb, step, why, switched_at=_now())
    RebalanceStep.objects.filter(pk=step.pk, state=S.SWITCHING).update(
        polls=step.polls + 1, explanation=f"waiting for its agent to restart it as {step.to_role}: {seen}"
    )
    return RESTART_POLL_S


def _switch_unknown(rb: Rebalance, step: RebalanceStep, why: str) -> float:
    """The switch request got no answer: the live role says whether it took effect."""
    try:
        state = pd.live_state(step.worker)
    except WorkerError as exc:
        return _to_rollback(rb, step, f"{why}; worker unreadable ({exc.message})")
    if state["role"] == step.from_role:
        return _fail(rb, step, f"{why}; role unchanged")
    return _to_rollback(
        rb, step, f"{why}; worker reports role {state['role']}", after=state, switched_at=_now()
    )


def _gate(rb: Rebalance, step: RebalanceStep) -> float:
    try:
        state = pd.live_state(step.worker)
    except WorkerError as exc:
        return _to_rollback(rb, step, f"gate: worker unreadable: {exc.message}")
    why = pd.gate(rb, step.worker, state, canary=True)
    if why:
        return _to_rollback(rb, step, f"gate failed: {why}", after=state)
    try:
        pd.router_add(rb, step.worker, state)
    except WorkerError as exc:
        return _to_rollback(rb, step, f"router re-add as {state['role']} failed: {exc.message}", after=state)
    baseline = _slo_baseline(rb)
    step_transition(
        step,
        to=S.SOAKING,
        after=state,
        drained=False,
        soak={"baseline": baseline},
        soak_until=_now() + timedelta(seconds=rb.soak_s),
        explanation=f"gates passed (health, {'bootstrap, ' if state['role'] == 'prefill' else ''}"
        f"{len(rb.canary['prompts'])} canaries); "
        f"re-added as {state['role']}; soaking {rb.soak_s:g}s",
    )
    return SOAK_POLL_S


def _slo_baseline(rb: Rebalance) -> dict | None:
    """The soak's SLO baseline (`slo.snapshot`): {} when no SLO is set, None while the TSDB does not answer
    (the soak takes it later, and its SLO window starts then)."""
    if not slo.thresholds(rb.slo):
        return {}
    try:
        return slo.snapshot(rb)
    except promql.PromQLError:
        return None


def _slo_breach(rb: Rebalance, step: RebalanceStep) -> str | None:
    """Which SLO the soak breached ('' for none), or None when it cannot tell: the TSDB does not answer (no
    baseline yet: it is taken now, and the SLO window starts here)."""
    soak = step.soak or {}
    if not slo.thresholds(rb.slo):
        return ""
    try:
        if soak.get("baseline") is None:
            baseline = slo.snapshot(rb)
            RebalanceStep.objects.filter(pk=step.pk).update(soak={**soak, "baseline": baseline})
            step.soak = {**soak, "baseline": baseline}
            return ""
        return slo.breach(rb, soak["baseline"])
    except promql.PromQLError:
        return None


def _soak(rb: Rebalance, step: RebalanceStep) -> float:
    worker = step.worker
    try:
        entry = pd.router_entry(rb, worker)
        pd.client_for(worker).health()
    except WorkerError as exc:
        return _to_rollback(rb, step, f"soak: {exc.message}")
    joined = entry is not None and entry.get("is_healthy", True) and entry.get("worker_type") == step.to_role
    breach = _slo_breach(rb, step)
    if breach:
        return _to_rollback(rb, step, f"SLO breached during soak: {breach}")
    left = (step.soak_until - _now()).total_seconds()
    if breach is None:  # cannot say the SLO holds: wait for the TSDB, never pass unchecked
        why = unavailable_text(promql.unavailable_since() or _now().timestamp())
        RebalanceStep.objects.filter(pk=step.pk, state=S.SOAKING).update(
            explanation=f"soaking as {step.to_role}: {max(left, 0):.0f}s left; SLO not checked: {why}"
        )
        return SOAK_POLL_S
    if left > 0 or not joined:
        if not joined and left < -settings.REBALANCE_ROUTER_JOIN_TIMEOUT_S:
            return _to_rollback(rb, step, f"router does not list it healthy as {step.to_role}: {entry}")
        held = f"SLO holds ({slo.describe(rb.slo)})" if slo.thresholds(rb.slo) else slo.NO_SLO
        what = held if joined else "waiting for the router to list it healthy"
        RebalanceStep.objects.filter(pk=step.pk, state=S.SOAKING).update(
            explanation=f"soaking as {step.to_role}: {max(left, 0):.0f}s left; {what}"
        )
        return SOAK_POLL_S
    state = pd.live_state(worker)
    worker_role_observed(worker=worker, role=state["role"])
    served = f"served {rb.soak_s:g}s"
    served += f" within SLO ({slo.describe(rb.slo)})" if slo.thresholds(rb.slo) else f" ({slo.NO_SLO})"
    step_transition(
        step,
        to=S.SUCCEEDED,
        after=state,
        explanation=f"{step.from_role} -> {step.to_role} ({_how(step)}): role verified in /server_info, "
        f"gates passed, {served}",
    )
    return 0


def _rollback_fail(rb: Rebalance, step: RebalanceStep, why: str, *, readd: bool = True) -> float:
    """The rollback could not finish: record the live role and put the worker back in the router in it."""
    fields: dict = {}
    try:
        state = pd.live_state(step.worker)
        fields["after"] = state
        if readd and state["role"] in ("prefill", "decode"):
            pd.router_add(rb, step.worker, state)
            worker_role_observed(worker=step.worker, role=state["role"])
            why += f"; left as {state['role']}, re-added to the router"
    except WorkerError as exc:
        why += f"; left out of the router ({exc.message})"
    step_transition(step, to=S.ROLLBACK_FAILED, explanation=why, **fields)
    return 0


def _rollback_limit(step: RebalanceStep):
    """How long a rollback may wait: the idle deadline, plus, for the restart method,
    REBALANCE_RESTART_TIMEOUT_S for the agent's restart."""
    limit = step.idle_deadline_at
    if step.method == SwitchMethod.RESTART:
        limit += timedelta(seconds=settings.REBALANCE_RESTART_TIMEOUT_S)
    return limit


def _settle_restart(rb: Rebalance, step: RebalanceStep) -> float | None:
    """Restart method, before a rollback trusts the process /server_info answers from: withdraw the step's
    request to the agent (a no-op once carried out) and wait, polled every RESTART_POLL_S, until the agent
    reports having seen the withdrawal's generation (``role_seen_seq``): it has then restarted the worker
    or never will, so the process seen next is the one that stays. None once settled; past the rollback's
    deadline the step is rollback_failed and left out of the router (an agent that never answers might still
    act); else the delay before the next look."""
    if step.withdrawn_seq is None:
        seq = pd.withdraw_restart(rb, step.worker)
        RebalanceStep.objects.filter(pk=step.pk, state=S.ROLLING_BACK).update(withdrawn_seq=seq)
        step.withdrawn_seq = seq
    seen, _ = pd.agent_ack(step.worker)
    if seen >= step.withdrawn_seq:
        return None
    what = (
        f"withdrew its restart as {step.to_role} (request #{step.withdrawn_seq}); its agent has confirmed "
        f"#{seen}"
    )
    if _now() >= _rollback_limit(step):
        why = f"rollback: {what}, not #{step.withdrawn_seq} in time (it may still restart it); left out"
        return _rollback_fail(rb, step, why, readd=False)
    RebalanceStep.objects.filter(pk=step.pk, state=S.ROLLING_BACK).update(
        explanation=f"rolling back ({step.rollback_cause}): {what}; waiting for it to confirm the withdrawal"
    )
    return RESTART_POLL_S


def _how_back(step: RebalanceStep) -> str:
    if step.method == SwitchMethod.RESTART and step.restart_requested_at is None:
        return "not restarted: its agent confirmed it never carried out the withdrawn restart"
    return _how(step)


def _rollback_step(rb: Rebalance, step: RebalanceStep) -> float:  # noqa: C901
    """Drain (out of the router, idle; restart method: first settle the step's request with its agent, see
    _settle_restart), switch back (or ask its agent to restart it back and wait until it runs the old role,
    healthy), verify, gate (health, bootstrap), re-add in the old role."""
    worker = step.worker
    try:
        if pd.router_entry(rb, worker) is not None:
            pd.router_remove(rb, worker)
            RebalanceStep.objects.filter(pk=step.pk).update(drained=True)
        if step.method == SwitchMethod.RESTART and step.restart_requested_at is None:
            wait = _settle_restart(rb, step)  # then the process read next is the one that stays
            if wait is not None:
                return wait
        state = pd.live_state(worker)
    except WorkerError as exc:
        state, seen = None, f"unreachable ({exc.message})"
    if step.restart_requested_at is not None:  # this rollback asked the agent: wait for the old role
        state, seen = pd.restarted(worker, step.from_role)
        if state is None:
            seen = f"waiting for its agent to restart it as {step.from_role}: {seen}"
    elif state is not None and state["role"] != step.from_role:
        idle, seen = _idle(rb, step)
        if idle and step.method == SwitchMethod.RESTART:
            pd.request_restart(rb, worker, step.from_role, state["role"])
            RebalanceStep.objects.filter(pk=step.pk, state=S.ROLLING_BACK).update(
                restart_requested_at=_now(),
                explanation=f"rolling back ({step.rollback_cause}): asked its agent to restart it as "
                f"{step.from_role}",
            )
            return RESTART_POLL_S
        if idle:
            try:
                client = pd.client_for(worker, settings.WORKER_APPLY_HTTP_TIMEOUT_S)
                answer = client.pd_role_switch(step.from_role)
                if not answer.success and "not idle" not in answer.message:
                    why = f"switch back refused: {answer.message}"
                    return _rollback_fail(rb, step, why, readd=answer.safe_to_restore)
                state = pd.live_state(worker)
            except WorkerError as exc:
                seen = f"switch back got no answer ({exc.message})"
    if state is None or state["role"] != step.from_role:
        if _now() >= _rollback_limit(step):
            waited = f"{rb.idle_timeout_s:g}s"
            if step.method == SwitchMethod.RESTART:
                waited += f" + {settings.REBALANCE_RESTART_TIMEOUT_S:g}s for its agent's restart"
            why = f"rollback: not back as {step.from_role} within {waited} (last seen {seen})"
            if step.restart_requested_at is not None:  # its agent may still act on it: not re-added
                pd.withdraw_restart(rb, worker)
                return _rollback_fail(rb, step, f"{why}; its restart withdrawn, left out of the router",
                                      readd=False)  # fmt: skip
            return _rollback_fail(rb, step, why)
        what = seen if step.restart_requested_at is not None else f"waiting for idle: {seen}"
        RebalanceStep.objects.filter(pk=step.pk, state=S.ROLLING_BACK).update(
            explanation=f"rolling back ({step.rollback_cause}): {what}"
        )
        return RESTART_POLL_S if step.restart_requested_at is not None else _poll()
    why = pd.gate(rb, worker, state, canary=False)
    if why:
        return _rollback_fail(rb, step, f"switched back, gate failed: {why}", readd=False)
    try:
        pd.router_add(rb, worker, state)
    except WorkerError as exc:
        return _rollback_fail(rb, step, f"switched back, router re-add failed: {exc.message}", readd=False)
    worker_role_observed(worker=worker, role=state["role"])
    step_transition(
        step,
        to=S.ROLLED_BACK,
        after=state,
        drained=False,
        explanation=f"rolled back to {step.from_role} ({_how_back(step)}; cause: {step.rollback_cause}); "
        "verified in /server_info, health and bootstrap gates passed, re-added",
    )
    return 0


RUNNERS = {
    S.DRAINING: _drain,
    S.SWITCHING: _switch,
    S.GATING: _gate,
    S.SOAKING: _soak,
    S.ROLLING_BACK: _rollback_step,
}
