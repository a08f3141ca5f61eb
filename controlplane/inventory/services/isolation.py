"""The cache isolation self-test of a worker, run from the control plane (API and console button).

It is the check ``kvfleet-agent check-isolation`` runs (``engine/agent/isolation.py`` through
``WorkerClient.check_isolation``, not a copy): one fresh prompt as salt A, salt B, salt A. Every run is
audited on the worker (action ``check_isolation``), a failed check or an unreachable worker as a failure.
"""

from controlplane.audit.models import Outcome
from controlplane.audit.services import audit_record
from controlplane.core.exceptions import ApplicationError
from controlplane.inventory.models import EngineWorker
from controlplane.workerclient import WorkerClient, WorkerError

MIN_WORDS, MAX_WORDS = 32, 4000


def worker_check_isolation(*, worker: EngineWorker, actor, words: int = 400) -> dict:
    """Run the isolation self-test against ``worker`` (its inventory ``api_key`` as bearer), about ``words``
    prompt tokens (32..4000). Returns ``{worker, ok, verdict, prompt_tokens, ttft_other_salt_s,
    ttft_same_salt_s, probes: [{salt, cached: {device, host, storage}, ttft_s}], problems}``: ``ok`` when
    the other salt reused nothing, the same salt reused the prompt and the answers agree; ``verdict``
    ``isolated``, ``failed``, or ``inconclusive`` (the URL is a router with several workers); TTFTs in seconds
    (the worker's own ``meta_info.ttft``). Raises ApplicationError 400 for ``words`` out of range, 502
    (``worker_error``) when the worker cannot be checked (both audited)."""
    if not MIN_WORDS <= words <= MAX_WORDS:
        raise ApplicationError(
            f"words must be between {MIN_WORDS} and {MAX_WORDS}",
            code="invalid",
            detail={"words": [f"must be between {MIN_WORDS} and {MAX_WORDS}"]},
        )
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
    cold, other, again = report.probes
    answer = {
        "worker": worker.pk,
        "ok": report.ok,
        "verdict": "isolated" if report.ok else "inconclusive" if report.inconclusive else "failed",
        "prompt_tokens": report.prompt_tokens,
        "ttft_other_salt_s": other.ttft_s,
        "ttft_same_salt_s": again.ttft_s,
        "probes": [
            {"salt": p.salt, "cached": p.cached, "ttft_s": p.ttft_s, "first": i == 0}
            for i, p in enumerate(report.probes)
        ],
        "problems": list(report.problems),
    }
    audit_record(
        action="check_isolation",
        obj=worker,
        outcome=Outcome.SUCCESS if report.ok else Outcome.FAILURE,
        after={k: answer[k] for k in ("verdict", "prompt_tokens", "ttft_other_salt_s", "ttft_same_salt_s")},
        message=f"isolation check of {worker.name}: {answer['verdict']}"
        + (f" ({'; '.join(report.problems)})" if report.problems else ""),
        extra={"probes": answer["probes"]},
        actor=actor,
    )
    return answer
