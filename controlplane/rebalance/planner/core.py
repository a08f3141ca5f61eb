"""The P:D planner's decision: pure functions over one window of pool figures (no Django, no I/O).

Advisory, like Dynamo's planner in ADVISORY mode: it says which (prefill, decode) split of a PD router's
workers fits the traffic and why; a person or a policy starts the rebalance.

Everything is counted in devices: a worker of ``--tp-size`` N spans N devices, so a TP-2 worker that
switches roles moves two devices. Splits are the (prefill devices, decode devices) the router's workers can
form by changing whole workers' roles; with TP-1 workers only, devices and workers are the same numbers.

Math (per pool, over the window the inputs module aggregates):
- demand: prefill = prompt tokens/s that had to be computed, i.e. input tokens/s minus the tokens served from
  cache on any tier (device, host, storage; the hit-rate discount of Dynamo v2's ``effective_isl``); decode =
  output tokens/s. Measured on the warm workers and scaled to the pool's size (the router spreads load).
  A pool whose waiting queue grows is served less than what arrives (a saturated pool's throughput is its
  capacity, not the demand): the queue's growth, requests/s, times the tokens per served request is added
  to the demand as unserved tokens/s. A shrinking queue (a backlog draining) is not subtracted.
- per-device capacity at SLO: the per-device load (what the warm workers served over the devices they
  span) times ``gain = SLO / measured p90`` (TTFT for prefill, ITL
  for decode), the latency-ratio correction of Dynamo v1's SLA planner applied to live figures; capped at
  ``max_gain`` (never extrapolate further than that from what was measured) and, for decode, at
  ``kv_limit / kv_usage`` (a decode worker cannot hold more than its KV pool).
- utilisation of a pool of k devices = demand / (k * capacity); needed devices = ceil(demand / (capacity *
  (1 - headroom))).
- the split: every (P, D) devices with P + D = budget that whole workers can form, each pool with at least
  ``min_workers`` workers, scored by the larger of the two pools' utilisations (the pool closest to its SLO
  decides); the lowest score wins, ties keep the current split. Among the ways to reach a split, the one
  changing the fewest workers' roles is the one recommended.

Anti-flap (Dynamo's "persist for M evaluations + cooldown", Dynamo #9294's consolidation margin):
- each pool's load (devices needed at 100 %: demand / per-device capacity) is smoothed across evaluations
  (EWMA, time constant ``smoothing_s``), so one noisy p90 does not decide;
- a change is proposed only when the current split breaches ``1 - headroom`` utilisation in some pool and
  the best split lowers the worst utilisation by at least ``margin`` (relative); a shown change is replaced
  only by a split beating it by the same margin, and withdrawn only when the current split fits with the
  margin to spare (hysteresis);
- a proposal becomes a recommendation ("change") only after it has been the proposal for ``persist_s``,
  counted from when the smoothing has run for ``smoothing_s`` (its first figures are the least smoothed);
  going back to "hold" needs the same persistence;
- no proposal for ``cooldown_s`` after the router's counts last changed, none while ``frozen`` (a rollout
  runs, or actual != expected), and none without data from both pools.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

TIERS = ("device", "host", "storage")
PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class Slo:
    """Per-router targets, seconds: TTFT p90 (prefill pool) and ITL p90 (decode pool)."""

    ttft_p90_s: float
    itl_p90_s: float


@dataclass(frozen=True)
class PlannerConfig:
    headroom: float = 0.2  # keep this share of capacity spare: target utilisation 1 - headroom
    margin: float = 0.15  # a new split must lower the worst utilisation by this share (relative)
    smoothing_s: float = 60.0  # time constant of the EWMA over evaluations of each pool's load
    persist_s: float = 60.0  # a proposal must hold this long before it is recommended (and to go back)
    cooldown_s: float = 300.0  # no proposal this long after a role change / a rebalance ended
    max_gain: float = 4.0  # capacity <= 4x the measured per-worker load
    kv_limit: float = 0.9  # a decode worker is full at 90 % KV usage
    min_workers: int = 1  # workers per pool


@dataclass(frozen=True)
class PoolLoad:
    """One pool's figures over the window, from its warm workers (rates per second, latencies seconds).

    ``workers`` is how many warm workers the figures come from; ``cached_tokens_per_s`` maps each tier
    (device, host, storage) to prompt tokens/s served from it; ``kv_usage`` is the mean KV pool use, 0..1;
    ``queue_reqs`` the mean number of requests waiting (per worker, summed over the pool's warm workers) and
    ``queue_growth_per_s`` how fast that number grew over the window, requests/s (negative: it shrank);
    ``devices`` the devices those warm workers span (the sum of their tp sizes; None: one each).
    """

    workers: int
    request_rate: float = 0.0
    input_tokens_per_s: float = 0.0
    cached_tokens_per_s: dict = field(default_factory=dict)
    output_tokens_per_s: float = 0.0
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    queue_reqs: float = 0.0
    queue_growth_per_s: float = 0.0
    kv_usage: float | None = None
    devices: int | None = None

    @property
    def warm_devices(self) -> int:
        return self.workers if self.devices is None else self.devices

    @property
    def cached_total(self) -> float:
        return sum(self.cached_tokens_per_s.get(t, 0.0) for t in TIERS)

    @property
    def computed_tokens_per_s(self) -> float:
        return max(0.0, self.input_tokens_per_s - self.cached_total)

    @property
    def hit_rate(self) -> float:
        return min(1.0, self.cached_total / self.input_tokens_per_s) if self.input_tokens_per_s else 0.0


@dataclass(frozen=True)
class PoolWorker:
    """One PD worker of the router as the planner counts it: name, the role it runs, devices (tp_size)."""

    name: str
    role: str
    devices: int = 1


@dataclass(frozen=True)
class FleetView:
    """What the planner sees of one router now: its live counts in devices (prefill, decode), each pool's
    load (None: no warm worker reported), the budget (devices to split), when the counts last changed
    (Unix s), why it must not propose anything now (None: free), and its PD workers (None: ``current``'s
    counts as one-device workers)."""

    current: tuple[int, int]
    prefill: PoolLoad | None
    decode: PoolLoad | None
    budget: int
    slo: Slo
    last_change_at: float | None = None
    frozen: str | None = None
    workers: tuple[PoolWorker, ...] | None = None
    window_s: float | None = None  # the window the pools' figures were taken over (s), named in the reasons

    def members(self) -> tuple[PoolWorker, ...]:
        if self.workers is not None:
            return self.workers
        roles = [(PREFILL, i) for i in range(self.current[0])] + [(DECODE, i) for i in range(self.current[1])]
        return tuple(PoolWorker(f"{role}-{i}", role) for role, i in roles)


@dataclass(frozen=True)
class PlannerState:
    """Carried from one evaluation to the next (JSON-able): the split shown as the recommendation, the
    proposal waiting to persist and since when."""

    shown: tuple[int, int] | None = None
    proposal: tuple[int, int] | None = None
    proposal_since: float | None = None
    smoothed: tuple[float, float] | None = None  # devices each pool needs at 100 % utilisation (EWMA)
    smoothed_at: float | None = None
    smoothed_for: tuple[int, int] | None = None  # the counts it was measured at (reset when they change)
    smoothed_since: float | None = None  # when the smoothing started (its warm-up counts from here)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> PlannerState:
        data = data or {}
        tup = lambda v: tuple(v) if v is not None else None  # noqa: E731
        return cls(
            tup(data.get("shown")),
            tup(data.get("proposal")),
            data.get("proposal_since"),
            tup(data.get("smoothed")),
            data.get("smoothed_at"),
            tup(data.get("smoothed_for")),
            data.get("smoothed_since"),
        )


@dataclass(frozen=True)
class PoolFigures:
    """The numbers behind one pool's part of a recommendation (see the module docstring for the math);
    loads and capacities are per device, ``needed_devices`` is in devices."""

    devices: int
    warm_devices: int
    workers: int
    warm_workers: int
    demand: float
    demand_unit: str
    input_tokens_per_s: float
    cached_tokens_per_s: dict
    hit_rate: float
    output_tokens_per_s: float
    request_rate: float
    latency_p90_s: float | None
    slo_p90_s: float
    gain: float
    gain_limit: str
    per_device_load: float
    per_device_capacity: float
    utilisation: float
    needed_devices: int
    queue_reqs: float
    queue_growth_per_s: float
    unserved_per_s: float
    kv_usage: float | None


def pool_figures(
    role: str, load: PoolLoad, devices: int, slo_s: float, cfg: PlannerConfig, workers: int | None = None
) -> PoolFigures | None:
    """Demand, capacity at SLO and utilisation of a pool of ``devices`` (in ``workers`` workers; None: one
    device each); None without traffic or latency. Capacity comes from what the warm workers served over
    the devices they span; demand adds what a growing queue left unserved."""
    prefill = role == PREFILL
    measured = load.computed_tokens_per_s if prefill else load.output_tokens_per_s
    latency = load.ttft_p90_s if prefill else load.itl_p90_s
    if load.workers <= 0 or measured <= 0 or not latency or latency <= 0:
        return None
    unserved = 0.0
    if load.queue_growth_per_s > 0 and load.request_rate > 0:
        unserved = load.queue_growth_per_s * measured / load.request_rate
    warm = load.warm_devices
    per_device = measured / warm
    gain, limit = slo_s / latency, "slo"
    if gain > cfg.max_gain:
        gain, limit = cfg.max_gain, "max_gain"
    if not prefill and load.kv_usage and cfg.kv_limit / load.kv_usage < gain:
        gain, limit = cfg.kv_limit / load.kv_usage, "kv"
    capacity = per_device * gain
    demand = (measured + unserved) / warm * devices
    return PoolFigures(
        devices=devices,
        warm_devices=warm,
        workers=devices if workers is None else workers,
        warm_workers=load.workers,
        demand=demand,
        demand_unit="computed prompt tokens/s" if prefill else "output tokens/s",
        input_tokens_per_s=load.input_tokens_per_s,
        cached_tokens_per_s={t: load.cached_tokens_per_s.get(t, 0.0) for t in TIERS},
        hit_rate=load.hit_rate,
        output_tokens_per_s=load.output_tokens_per_s,
        request_rate=load.request_rate,
        latency_p90_s=latency,
        slo_p90_s=slo_s,
        gain=gain,
        gain_limit=limit,
        per_device_load=per_device,
        per_device_capacity=capacity,
        utilisation=demand / (devices * capacity),
        needed_devices=max(1, math.ceil(demand / (capacity * (1 - cfg.headroom)) - 1e-9)),
        queue_reqs=load.queue_reqs,
        queue_growth_per_s=load.queue_growth_per_s,
        unserved_per_s=unserved / warm * devices,
        kv_usage=load.kv_usage,
    )


Split = tuple[int, int]
Plan = tuple[
    int, tuple[str, ...]
]  # (role changes, the role each worker gets: prefill | decode | "" left out)


def split_plans(members: tuple[PoolWorker, ...], budget: int, min_workers: int = 1) -> dict[Split, Plan]:
    """Every (prefill, decode) device split of ``budget`` that whole workers form (each one prefill, decode
    or, when the budget is below the fleet's devices, left out), each pool with at least ``min_workers``
    workers; for each, the assignment changing the fewest workers' roles (ties: the workers later in
    ``members``' order change). A sketch of which workers could move: a rebalance picks its own donors."""
    left = [sum(m.devices for m in members[i:]) for i in range(len(members) + 1)]
    states: dict[tuple[int, int, int, int], Plan] = {(0, 0, 0, 0): (0, ())}
    for i, m in enumerate(members):
        step: dict[tuple[int, int, int, int], Plan] = {}
        choices = (m.role, DECODE if m.role == PREFILL else PREFILL, "")
        for (p, d, n_p, n_d), (moves, roles) in states.items():
            for role in choices:
                key = (
                    p + (m.devices if role == PREFILL else 0),
                    d + (m.devices if role == DECODE else 0),
                    min(min_workers, n_p + (role == PREFILL)),
                    min(min_workers, n_d + (role == DECODE)),
                )
                if key[0] + key[1] > budget or key[0] + key[1] + left[i + 1] < budget:
                    continue
                plan = (moves + (role not in ("", m.role)), (*roles, role))
                if key not in step or plan[0] < step[key][0]:
                    step[key] = plan
        states = step
    out: dict[Split, Plan] = {}
    for (p, d, n_p, n_d), plan in states.items():
        if n_p >= min_workers and n_d >= min_workers and ((p, d) not in out or plan[0] < out[(p, d)][0]):
            out[(p, d)] = plan
    return out


def _split_name(t: Split) -> str:
    return f"{t[0]}P:{t[1]}D"


def _worst(load: tuple[float, float], split: Split) -> float:
    """The higher of the two pools' utilisations with ``split`` devices."""
    return max(load[0] / split[0], load[1] / split[1])


def best_split(load: tuple[float, float], splits: list[Split], prefer: list[Split]) -> Split | None:
    """The split of ``splits`` minimising the worse pool utilisation; ties go to ``prefer`` in order."""
    if not splits:
        return None
    rank = {s: i for i, s in enumerate(prefer)}
    return min(splits, key=lambda s: (_worst(load, s), rank.get(s, len(rank)), abs(s[0] - prefer[0][0])))


@dataclass(frozen=True)
class Recommendation:
    status: str  # hold | pending | change | cooldown | frozen | insufficient_data
    current: Split
    recommended: Split
    summary: str
    reasons: list[str]
    pools: dict  # role -> PoolFigures | None
    budget: int
    slo: Slo
    evaluated_at: float
    current_workers: Split = (0, 0)
    recommended_workers: Split = (0, 0)
    moves: tuple = ()  # ({worker, from_role, to_role, devices}, ...) from current to recommended
    # role -> the pool's utilisation of the smoothed load (`_smooth`) the split is chosen on, with the
    # current devices; absent where this evaluation did not smooth (frozen, cooldown, missing figures)
    smoothed_utilisation: dict = field(default_factory=dict)
    # devices the pools need beyond the router's budget (0: they fit): no split can serve the load; and
    # the sentence saying so ("add capacity: ...", "" when they fit)
    devices_short: int = 0
    capacity_advice: str = ""

    def to_dict(self) -> dict:
        pair = lambda t: {PREFILL: t[0], DECODE: t[1]}  # noqa: E731
        return {
            "evaluated_at": self.evaluated_at,
            "status": self.status,
            "unit": "devices",
            "current": pair(self.current),
            "recommended": pair(self.recommended),
            "current_workers": pair(self.current_workers),
            "recommended_workers": pair(self.recommended_workers),
            "moves": [dict(m) for m in self.moves],
            "change": self.recommended != self.current,
            "summary": self.summary,
            "reasons": self.reasons,
            "pools": {role: asdict(f) if f else None for role, f in self.pools.items()},
            "budget": self.budget,
            "slo": asdict(self.slo),
            "smoothed_utilisation": dict(self.smoothed_utilisation),
            "devices_short": self.devices_short,
            "capacity_advice": self.capacity_advice,
        }


def figure(v: float) -> str:
    """A rate or count for a sentence, at the precision the console's tables show it: three significant
    digits below 100 (``0.37``, ``14.2``), whole numbers with thousands separators above (``2,000``), so a
    reason never reads "0" where the table next to it says 0.37."""
    if v == 0 or abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def _explain(role: str, f: PoolFigures, cfg: PlannerConfig, window_s: float | None = None) -> str:
    lat = "TTFT" if role == PREFILL else "ITL"
    over = f" over the last {window_s:g} s" if window_s else ""
    warm = f"{f.warm_workers} warm worker(s)" + (
        f" on {f.warm_devices} device(s)" if f.warm_devices != f.warm_workers else ""
    )
    if role == PREFILL:
        source = f"input {figure(f.input_tokens_per_s)} tokens/s on {warm}"
        cache = f"{f.hit_rate:.0%} served from cache, scaled to {f.devices} device(s)"
        demand = f"prefill demand {figure(f.demand)} computed prompt tokens/s{over} ({source}, {cache})"
    else:
        demand = f"decode demand {figure(f.demand)} output tokens/s{over} ({f.devices} device(s), {warm})"
    if f.unserved_per_s >= 0.5:  # below, it would read "0 unserved": negligible, said as not growing
        waiting = f" ({f.queue_reqs:.1f} waiting on average)" if f.queue_reqs > 0 else ""
        demand += (
            f"; its queue grew by {figure(f.queue_growth_per_s)} requests/s{waiting} while it served "
            f"{figure(f.request_rate)} requests/s: more arrives than it serves, so "
            f"{figure(f.unserved_per_s)} unserved {f.demand_unit} are counted in (the {role} pool is short)"
        )
    elif f.queue_reqs >= 1:
        trend = "shrinking: a backlog draining" if f.queue_growth_per_s < 0 else "not growing"
        demand += f"; {f.queue_reqs:.1f} requests wait on average ({trend}: no demand added)"
    limit = f"{lat} p90 {f.latency_p90_s:.3f} s{over} against an SLO of {f.slo_p90_s:.3f} s"
    if f.gain_limit == "max_gain":
        limit += f" (far below it: capped at {cfg.max_gain:g}x the measured load)"
    elif f.gain_limit == "kv":
        limit += f" (KV usage {f.kv_usage:.0%} caps it at {cfg.kv_limit:.0%} KV)"
    capacity = f"so {figure(f.per_device_capacity)} at the SLO; utilisation {f.utilisation:.0%}"
    need = f"with {cfg.headroom:.0%} headroom it needs {f.needed_devices} device(s)"
    return f"{demand}; each device serves {figure(f.per_device_load)} at {limit}, {capacity}; {need}."


def _smooth(state: PlannerState, raw: tuple[float, float], current: Split, now: float, cfg: PlannerConfig):
    """(EWMA of each pool's load, when the smoothing started); restarts when the counts change."""
    if cfg.smoothing_s <= 0:  # no smoothing
        return raw, now
    if state.smoothed is None or state.smoothed_for != current or state.smoothed_at is None:
        return raw, now
    alpha = 1 - math.exp(-max(0.0, now - state.smoothed_at) / cfg.smoothing_s)
    smoothed = tuple(a + alpha * (r - a) for a, r in zip(state.smoothed, raw, strict=True))
    return smoothed, state.smoothed_since if state.smoothed_since is not None else now


def evaluate(
    view: FleetView, state: PlannerState, now: float, cfg: PlannerConfig = PlannerConfig()
) -> tuple[Recommendation, PlannerState]:
    """One planner tick: the recommendation to show and the state to keep for the next tick."""
    current, members = view.current, view.members()
    n_workers = tuple(sum(m.role == role for m in members) for role in (PREFILL, DECODE))
    pools = {
        PREFILL: view.prefill
        and pool_figures(PREFILL, view.prefill, current[0], view.slo.ttft_p90_s, cfg, n_workers[0]),
        DECODE: view.decode
        and pool_figures(DECODE, view.decode, current[1], view.slo.itl_p90_s, cfg, n_workers[1]),
    }
    reasons = [_explain(role, f, cfg, view.window_s) for role, f in pools.items() if f]
    if view.frozen:
        summary = f"No recommendation: {view.frozen}."
        return _rec(
            "frozen", current, current, summary, [view.frozen, *reasons], pools, view, now
        ), PlannerState()
    missing = [role for role, f in pools.items() if not f]
    if missing:
        why = f"no traffic or latency figures yet from warm {' and '.join(missing)} workers"
        summary = f"Keep {_split_name(current)}: {why}."
        return _rec(
            "insufficient_data", current, current, summary, [*reasons, why], pools, view, now
        ), PlannerState()
    short = _devices_short(pools[PREFILL], pools[DECODE], view.budget, cfg)
    if view.last_change_at is not None and now - view.last_change_at < cfg.cooldown_s:
        ago = now - view.last_change_at
        left = cfg.cooldown_s - ago
        what = "a worker's role changed or a rebalance ended"
        why = f"{what} {ago:.0f} s ago; cooldown {cfg.cooldown_s:.0f} s ({left:.0f} s left)"
        summary = f"Keep {_split_name(current)}: {why}."
        rec = _rec("cooldown", current, current, summary, [*reasons, why], pools, view, now, short=short)
        return rec, PlannerState()
    pre, dec = pools[PREFILL], pools[DECODE]
    load, smoothed_since = _smooth(
        state, (pre.demand / pre.per_device_capacity, dec.demand / dec.per_device_capacity), current, now, cfg
    )
    plans = split_plans(members, view.budget, cfg.min_workers)
    shown = state.shown if state.shown is not None and state.shown in plans else current
    proposal, why = _propose(load, current, shown, view.budget, sorted(plans), cfg)
    reasons.append(why)
    kept = dict(smoothed=load, smoothed_at=now, smoothed_for=current, smoothed_since=smoothed_since)
    new_state = PlannerState(shown=shown, **kept)
    if proposal != shown:
        same = state.proposal == proposal and state.proposal_since is not None
        since = state.proposal_since if same else now
        # held long enough, counted once the smoothing has warmed up (early figures are its least smoothed)
        if now - max(since, smoothed_since + cfg.smoothing_s) >= cfg.persist_s:
            new_state, shown = PlannerState(shown=proposal, **kept), proposal
        else:
            new_state = PlannerState(shown=shown, proposal=proposal, proposal_since=since, **kept)
            warm = smoothed_since + cfg.smoothing_s - now
            reasons.append(
                f"{_split_name(proposal)} has been the proposal for {now - since:.0f} s; it must hold "
                f"{cfg.persist_s:.0f} s"
                + (f" after the smoothing warms up (in {warm:.0f} s)" if warm > 0 else "")
                + f" before it replaces {_split_name(shown)}"
            )
    if shown == current and new_state.proposal is not None:
        status = "pending"
        held = f"it must hold {cfg.persist_s:.0f} s"
        summary = f"Keep {_split_name(current)} for now: {_split_name(proposal)} is proposed ({held})."
    elif shown == current:
        status, summary = "hold", f"Keep {_split_name(current)}."
    else:
        status = "change"
        summary = _move_sentence(current, shown, _moves(view, plans.get(shown)), view.workers is not None)
    smoothed_use = {PREFILL: load[0] / current[0], DECODE: load[1] / current[1]} if all(current) else {}
    rec = _rec(status, current, shown, summary, reasons, pools, view, now, plans, short, smoothed_use)
    return rec, new_state


def _devices_short(pre: PoolFigures, dec: PoolFigures, budget: int, cfg: PlannerConfig) -> tuple[int, str]:
    """(devices the two pools need beyond ``budget``, the sentence saying so); (0, "") when they fit."""
    need = pre.needed_devices + dec.needed_devices
    if need <= budget:
        return 0, ""
    return need - budget, (
        f"add capacity: with {cfg.headroom:.0%} headroom the pools need {need} device(s) "
        f"({pre.needed_devices} prefill + {dec.needed_devices} decode) and the router has {budget}, so no "
        f"split of its devices meets both SLOs; add {need - budget} device(s) (workers on this router) "
        f"or shed load"
    )


def _moves(view: FleetView, plan: Plan | None) -> tuple[dict, ...]:
    """The role changes of ``plan`` as {worker, from_role, to_role, devices}."""
    if plan is None:
        return ()
    return tuple(
        {"worker": m.name, "from_role": m.role, "to_role": role, "devices": m.devices}
        for m, role in zip(view.members(), plan[1], strict=True)
        if role and role != m.role
    )


def _propose(
    load, current: Split, shown: Split, budget: int, splits: list[Split], cfg: PlannerConfig
) -> tuple[Split, str]:
    """The split to propose now among ``splits`` (those whole workers form), and why (utilisations from the
    smoothed loads)."""
    target = 1 - cfg.headroom
    best = best_split(load, splits, [current, shown])
    if best is None:
        return current, (
            f"no split of {budget} device(s) in whole workers holds {cfg.min_workers} worker(s) of each role"
        )
    # the loads are smoothed (EWMA over evaluations, `_smooth`), so these utilisations lag the table's, which
    # are this evaluation's own: each sentence says so, with the smoothing's time constant
    smoothed = f"smoothed over ~{cfg.smoothing_s:g} s: " if cfg.smoothing_s > 0 else ""
    util = lambda s: (  # noqa: E731
        f"{_split_name(s)} ({smoothed}prefill {load[0] / s[0]:.0%}, decode {load[1] / s[1]:.0%})"
    )
    now_worst, best_worst = _worst(load, current), _worst(load, best)
    if sum(current) != budget:
        return (
            best,
            f"the budget is {budget} device(s) and the router has {sum(current)}; best split {util(best)}",
        )
    if shown != current:
        if now_worst <= target * (1 - cfg.margin):
            return current, f"{util(current)} fits again, with the margin to spare"
        if best != shown and best_worst <= _worst(load, shown) * (1 - cfg.margin):
            return best, f"{util(best)} beats the recommended {util(shown)}"
        return shown, f"{util(shown)} against {util(current)} now"
    if now_worst <= target:
        return (
            current,
            f"{_split_name(current)} fits: no pool above {target:.0%} utilisation ({util(current)})",
        )
    if best == current or best_worst > now_worst * (1 - cfg.margin):
        return current, (
            f"{util(current)} runs a pool over {target:.0%}, but no split of {budget} device(s) "
            f"lowers the worse pool by {cfg.margin:.0%} or more"
            + ("" if best == current else f" (best {util(best)})")
        )
    return (
        best,
        f"{util(current)} runs a pool over {target:.0%}; "
        f"{util(best)} brings the worse pool to {best_worst:.0%}",
    )


def _move_sentence(current: Split, target: Split, moves: tuple[dict, ...], named: bool) -> str:
    """E.g. "Move 2 device(s) from decode to prefill (1 worker(s): d1 (TP 2)): 2P:6D -> 4P:4D devices."."""
    dp = target[0] - current[0]
    who = f"{len(moves)} worker(s)"
    if named and moves:
        who += ": " + ", ".join(
            m["worker"] + (f" (TP {m['devices']})" if m["devices"] > 1 else "") for m in moves
        )
    if sum(current) == sum(target) and dp:
        src, dst = (DECODE, PREFILL) if dp > 0 else (PREFILL, DECODE)
        return (
            f"Move {abs(dp)} device(s) from {src} to {dst} ({who}): "
            f"{_split_name(current)} -> {_split_name(target)} devices."
        )
    return f"Change {_split_name(current)} -> {_split_name(target)} devices ({who})."


def _rec(
    status,
    current,
    recommended,
    summary,
    reasons,
    pools,
    view: FleetView,
    now,
    plans: dict | None = None,
    short: tuple[int, str] = (0, ""),
    smoothed_use: dict | None = None,
) -> Recommendation:
    """The recommendation, with worker counts: the current ones, and those of the least-moving assignment
    of ``recommended`` (workers a budget leaves out count in the role they run)."""
    members = view.members()
    count = lambda roles: tuple(sum(r == role for r in roles) for role in (PREFILL, DECODE))  # noqa: E731
    workers = count([m.role for m in members])
    plan = (plans or {}).get(recommended) if recommended != current else None
    moves = _moves(view, plan)
    rec_workers = count([r or m.role for m, r in zip(members, plan[1], strict=True)]) if plan else workers
    return Recommendation(
        status, current, recommended, summary, reasons, pools, view.budget, view.slo, now, workers,
        rec_workers, moves, smoothed_use or {}, short[0], short[1],
    )  # fmt: skip


# ---- the EPD encoder pool: advice only ----
ENCODER = "encoder"


@dataclass(frozen=True)
class EncoderLoad:
    """The router's EPD encoders over the window: ``workers`` those with figures (two samples or more),
    ``images_per_s`` the images they ran through the vision tower per second (summed) and
    ``busy_s_per_s`` their encode seconds per wall second (summed: 1.0 is one vision tower busy all the
    time)."""

    workers: int
    images_per_s: float
    busy_s_per_s: float

    @property
    def utilisation(self) -> float:
        """Encode seconds per wall second per encoder, 0..1 (over 1 when an encoder encodes in parallel)."""
        return self.busy_s_per_s / self.workers if self.workers else 0.0


def encoder_advice(
    encoders: EncoderLoad | None, total: int, prefill: PoolLoad | None, slo: Slo, cfg: PlannerConfig
) -> dict | None:
    """Whether the router's encoder pool (``total`` encoders) should grow; None when it has none.

    Encoders are their own pool: never in a P:D split, never a role to switch (they run no language model),
    so this is a recommendation only. ``advice`` is ``add_encoder`` when the encoders' utilisation reaches
    ``1 - headroom`` while prefill waits: its TTFT p90 is over the SLO (a language-only prefill worker fetches
    a request's embeddings before queueing it, so a wait for encoders shows in TTFT) or its queue holds or
    gains requests; ``hold`` otherwise; ``insufficient_data`` when no encoder has two samples in the window.
    ``message`` says why in words; utilisation is encode seconds per wall second per encoder (0..1)."""
    if total <= 0:
        return None
    base = {"workers": total, "warm_workers": 0, "images_per_s": None, "utilisation": None}
    if encoders is None or not encoders.workers:
        return {
            **base,
            "advice": "insufficient_data",
            "message": f"{total} encoder(s): no encoder has two samples in the window yet",
        }
    util, limit = encoders.utilisation, 1.0 - cfg.headroom
    out = {
        **base,
        "warm_workers": encoders.workers,
        "images_per_s": encoders.images_per_s,
        "utilisation": util,
        "encode_s_per_image": encoders.busy_s_per_s / encoders.images_per_s
        if encoders.images_per_s
        else None,
    }
    ttft = prefill.ttft_p90_s if prefill else None
    waits = []
    if ttft is not None and ttft > slo.ttft_p90_s:
        waits.append(f"TTFT p90 {ttft:.3g} s is over its SLO {slo.ttft_p90_s:.3g} s")
    if prefill and (prefill.queue_reqs > 0 or prefill.queue_growth_per_s > 0):
        waits.append(f"prefill holds {prefill.queue_reqs:.3g} queued requests")
    busy = f"encoders busy {util:.0%} (encode seconds per second per encoder, limit {limit:.0%})"
    if util >= limit and waits:
        return {
            **out,
            "advice": "add_encoder",
            "message": f"add an encoder: {busy} while prefill waits ({'; '.join(waits)}). "
            "A recommendation only: no prefill or decode worker is switched to encode.",
        }
    why = "prefill does not wait" if util >= limit else "below the limit"
    return {**out, "advice": "hold", "message": f"{total} encoder(s) enough: {busy}, {why}"}
