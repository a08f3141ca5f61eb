"""A failed step's rebalance says in words which finished steps it rolls back or keeps (step numbers as
every table shows them, 1 for the first), never a raw list such as "rolling back steps []"."""

import pytest
from cp_factories import EngineWorkerFactory, RouterFactory

from controlplane.rebalance.models import Rebalance, RebalanceStep
from controlplane.rebalance.services.steps import _after_failure, steps_text

pytestmark = pytest.mark.django_db


def _failed_after(finished: int, operator, *, rollback: bool = True) -> Rebalance:
    """A running rebalance whose first `finished` steps succeeded and whose next one failed."""
    router = RouterFactory(mode="pd")
    rb = Rebalance.objects.create(
        router=router, before_prefill=1, before_decode=3, target_prefill=1 + finished + 1,
        target_decode=3 - finished - 1, soak_s=1, idle_timeout_s=60, state="running", rollback=rollback,
        created_by=operator,
    )  # fmt: skip
    steps = [
        RebalanceStep.objects.create(
            rebalance=rb,
            index=i,
            worker=EngineWorkerFactory(router=router, role="decode"),
            from_role="decode",
            to_role="prefill",
            state="succeeded" if i < finished else "failed",
            explanation="" if i < finished else "its /health answered 503",
        )  # fmt: skip
        for i in range(finished + 1)
    ]
    _after_failure(rb, steps, steps[-1])
    rb.refresh_from_db()
    return rb


@pytest.mark.parametrize(
    ("finished", "says"),
    [(0, "; nothing to roll back"), (1, "; rolling back step 1"), (2, "; rolling back steps 2, 1")],
)
def test_a_failed_step_says_which_steps_roll_back_in_words(finished, says, personas):
    rb = _failed_after(finished, personas["operator"][0])
    assert rb.state == "rolling_back"
    assert rb.explanation.endswith(says), rb.explanation
    assert f"step {finished + 1} (" in rb.explanation and "[" not in rb.explanation


def test_a_failed_step_without_rollback_names_the_steps_it_keeps(personas):
    rb = _failed_after(2, personas["operator"][0], rollback=False)
    assert rb.state == "failed" and "(steps 1, 2 kept)" in rb.explanation, rb.explanation


def test_steps_text_reads_as_a_sentence():
    assert (steps_text([3]), steps_text([2, 1])) == ("step 3", "steps 2, 1")
