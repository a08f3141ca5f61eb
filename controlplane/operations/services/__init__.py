"""Operation services, one module per job:

- transitions: the one writer of OperationTarget.state (compare-and-set) and each outcome's audit record;
- launch: create (Idempotency-Key replay, revert-from-audit) and cancel;
- steps: the per-target step runner (apply and revert, drained and idle-waited alike);
- aggregation: an operation's state from its targets (starts all_or_nothing reverts, finishes);
- reaper: settles targets a lost task left behind, purges old Idempotency-Key records.
"""

from controlplane.core.state_machine import InvalidTransition
from controlplane.operations.services.aggregation import operation_refresh
from controlplane.operations.services.launch import (
    operation_cancel,
    operation_create,
    operation_create_from_audit,
    operation_create_idempotent,
    operation_snapshot,
)
from controlplane.operations.services.reaper import idempotency_purge, reap_stuck_targets
from controlplane.operations.services.steps import target_step
from controlplane.operations.services.transitions import target_transition

__all__ = [
    "InvalidTransition",
    "idempotency_purge",
    "operation_cancel",
    "operation_create",
    "operation_create_from_audit",
    "operation_create_idempotent",
    "operation_refresh",
    "operation_snapshot",
    "reap_stuck_targets",
    "target_step",
    "target_transition",
]
