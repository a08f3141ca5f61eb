"""Rebalance services, one module per job:

- plan: the steps from live roles to a target (pure);
- pd: what a step reads from and does to a PD worker and its router (through controlplane.workerclient);
- slo: p90 TTFT/ITL over a soak window from the workers' histograms;
- transitions: the one writer of both state machines, their audit records and websocket pushes;
- launch: create, approve, pause, resume, abort;
- steps: the step runner the Celery task calls;
- reaper: restarts the task chain of a rebalance whose chain was lost.
"""

from controlplane.core.state_machine import InvalidTransition
from controlplane.rebalance.services.launch import (
    rebalance_abort,
    rebalance_approve,
    rebalance_create,
    rebalance_pause,
    rebalance_resume,
)
from controlplane.rebalance.services.reaper import rebalance_resume_stalled
from controlplane.rebalance.services.steps import rebalance_advance

__all__ = [
    "InvalidTransition",
    "rebalance_abort",
    "rebalance_advance",
    "rebalance_approve",
    "rebalance_create",
    "rebalance_pause",
    "rebalance_resume",
    "rebalance_resume_stalled",
]
