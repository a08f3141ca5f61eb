"""The cache isolation self-test of a worker, run from the control plane (API and console button).

It is the check ``kvfleet-agent check-isolation`` runs (``engine/agent/isolation.py`` through
``WorkerClient.check_isolation``, not a copy): one fresh prompt as salt A, salt B, salt A, sent to the worker
itself. Tenants reach it through its router, though, and a router that drops ``cache_salt`` (sglang-router
0.3.2 on /generate and chat) makes their salts share cache while the worker alone passes: so the worker's
router, as last probed (``router_identify``), is part of the answer, and a router known to drop the salt (or
not verified to pass it) fails the check with a problem that says so and names the supported way. A worker
that serves gRPC (``--grpc-mode`` on the command line its agent reports, or ``grpc_mode`` in its
``/server_info``) is not isolatable whatever its router does: no salt and no API key reaches it over gRPC, so
it is not probed and the answer says why (verdict ``not_isolatable``). Every run is audited on the worker
(action ``check_isolation``), a failed check or an unreachable worker as a failure.
"""

from controlplane.audit.models import Outcome
from controlplane.audit.services import audit_record
from controlplane.core.exceptions import ApplicationError
from controlplane.inventory.models import EngineWorker
from controlplane.inventory.selectors import router_cache_salt, worker_isolation_blocker
from controlplane.workerclient import WorkerClient, WorkerError
from engine.fleet.identity import grpc_isolation_problem

MIN_WORDS, MAX_WORDS = 32, 4000


def worker_check_isolation(*, worker: EngineWorker, actor, words: int = 400) -> dict:
    """Run the isolation self-test against ``worker`` (its inventory ``api_key`` as bearer), about ``words``
    prompt tokens (32..4000). Returns ``{worker, ok, verdict, prompt_tokens, ttft_other_salt_s,
    ttft_same_salt_s, probes: [{salt, cached: {device, host, storage}, ttft_s}], problems, router}``: ``ok``
    when the other salt reused nothing, the same salt reused the prompt and the answers agree; ``verdict``
    ``isolated``, ``failed``, ``inconclusive`` (the URL is a router with several workers) or
    ``not_isolatable`` (a gRPC worker: not probed, ``prompt_tokens`` 0, TTFTs null, ``probes`` [], the
    reason and the supported way in ``problems``); TTFTs in seconds (the worker's own ``meta_info.ttft``);
    ``router``: null without one, else ``{name, identified, router, routes, warning, grpc_workers,
    grpc_warning}`` (inventory's ``router_cache_salt``): a warning from an identified router is one of the
    ``problems`` and fails the check (a router not identified yet only warns). Raises ApplicationError 400
    for ``words`` out of range, 502 (``worker_error``) when the worker cannot be checked (both audited)."""
    if not MIN_WORDS <= words <= MAX_WORDS:
        raise ApplicationError(
            f"words must be between {MIN_WORDS} and {MAX_WORDS}",
            code="invalid",
            detail={"words": [f"must be between {MIN_WORDS} and {MAX_WORDS}"]},
        )
    salt = None if worker.router is None else {"name": worker.router.name, **router_cache_salt(worker.router)}
    blocker = worker_isolation_blocker(worker)
    report = None
    if not blocker:
        client = WorkerClient(worker.url, api_key=worker.api_key)
        try:
            report = client.check_isolation(words=words)
        except WorkerError as exc:
            audit_record(
                action="check_isolation",
                obj=worker,
                outcome=Outcome.FAILURE,
                message=f"isolation check of {worker.name} could not run: {exc.message}",
                actor=actor,
            )
            raise ApplicationError(
                f"worker {worker.name}: {exc.message}", code="worker_error", status_code=502
            ) from exc
        if report.not_isolatable:  # its /server_info says grpc_mode: named here as the inventory names it
            blocker = grpc_isolation_problem([worker.name])
    if report is None or blocker:
        answer: dict = {
            "worker": worker.pk,
            "ok": False,
            "verdict": "not_isolatable",
            "prompt_tokens": 0,
            "ttft_other_salt_s": None,
            "ttft_same_salt_s": None,
            "probes": [],
            "problems": [blocker],
            "router": salt,
        }
    else:
        answer = _judged(worker, report, salt)
    audit_record(
        action="check_isolation",
        obj=worker,
        outcome=Outcome.SUCCESS if answer["ok"] else Outcome.FAILURE,
        after={k: answer[k] for k in ("verdict", "prompt_tokens", "ttft_other_salt_s", "ttft_same_salt_s")},
        message=f"isolation check of {worker.name}: {answer['verdict']}"
        + (f" ({'; '.join(answer['problems'])})" if answer["problems"] else ""),
        extra={"probes": answer["probes"]},
        actor=actor,
    )
    return answer


def _judged(worker: EngineWorker, report, salt: dict | None) -> dict:
    """The answer for a probed worker: its report, failed by its router's salt warning (if identified)."""
    cold, other, again = report.probes
    problems = list(report.problems)
    if salt is not None and salt["identified"] and salt["warning"]:
        problems.append(f"through router {salt['name']}: {salt['warning']}")
    ok = report.ok and len(problems) == len(report.problems)
    return {
        "worker": worker.pk,
        "ok": ok,
        "verdict": "isolated" if ok else "inconclusive" if report.inconclusive else "failed",
        "prompt_tokens": report.prompt_tokens,
        "ttft_other_salt_s": other.ttft_s,
        "ttft_same_salt_s": again.ttft_s,
        "probes": [
            {"salt": p.salt, "cached": p.cached, "ttft_s": p.ttft_s, "first": i == 0}
            for i, p in enumerate(report.probes)
        ],
        "problems": problems,
        "router": salt,
    }
