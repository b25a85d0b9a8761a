"""A first hour without surprises, the unit tier: every alert's "Next:" line as a table (the runs:
tests/test_first_hour.py)."""

from __future__ import annotations

import pytest

from runner import policy
from runner.alerts import nextstep
from tests.test_policy import Limits

pytestmark = pytest.mark.unit


LIMITS = Limits(requeue=True, max_restarts=3)


EXIT = {"event": "exit", "outcome": "failed", "time": 1.0}


def slurm_next(outcome: str) -> str:
    """What the exit hook's alert says for a Slurm training run's first attempt ending with ``outcome``."""
    events = [{"event": "submitted", "time": 0.0}, {**EXIT, "outcome": outcome}]
    decision = policy.after_exit(outcome, 1, "7", LIMITS, events)
    requeued = True if decision.action == "requeue" else None
    return nextstep.next_step(outcome, decision, 1, LIMITS, requeued, events)


# (scheduler, workload, outcome) -> what the "Next:" line must say, and what it must not (a promise not kept there).
NEXT_STEPS = [
    ("slurm", "training", "failed", "runner cron resubmits it", None),
    ("slurm", "training", "hang", "runner cron resubmits it", None),
    ("slurm", "training", "preempted", "requeued as attempt 2", "runner resume"),
    ("slurm", "training", "timeout", "requeued as attempt 2", "runner resume"),
    ("slurm", "training", "nan", "stopped, not retried", "cron resubmits"),
    ("slurm", "training", "preflight_failed", "not retried", "cron resubmits"),
    ("local", "training", "failed", "`runner resume run-x`", "cron resubmits it"),
    ("local", "training", "hang", "`runner resume run-x`", "cron resubmits it"),
    ("local", "training", "nan", "fix the model or data", "cron resubmits it"),
    ("local", "training", "preflight_failed", "fix the check", "cron resubmits it"),
    ("local", "training", "completed", "nothing: training finished", "resume"),
    ("local", "parallel", "failed", "`runner resume run-x` runs the items not done", "cron resubmits it"),
    ("local", "parallel", "completed", "every item is done", "resume"),
]


@pytest.mark.parametrize(("scheduler", "workload", "outcome", "says", "never"), NEXT_STEPS)
def test_each_next_line_says_what_happens_next(scheduler: str, workload: str, outcome: str, says: str,
                                               never: str | None) -> None:
    if workload == "parallel":
        text = nextstep.parallel_next_step(outcome, "run-x")
    elif scheduler == "local":
        text = nextstep.local_next_step(outcome, "run-x")
    else:
        text = slurm_next(outcome)
    assert says in text, text
    assert never is None or never not in text, text
