"""The ranks agree on the step at which training stops, on two real gloo ranks (local tier; the rules alone are in
tests/test_agreement.py)."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest

from runner.job.agreement import STOP, SUPERSEDED, Agreement
from runner.job.stopflag import StopFlag
from tests.gloo_ranks import on_two_ranks

pytestmark = pytest.mark.local


def _agree(rank: int, case: str) -> tuple[int | None, str | None]:
    """The step at which this rank stops, and why; rank 0 alone is signalled, rank 1 alone finds another owner."""
    flag = StopFlag()
    agreement = Agreement(flag, lambda step: case != "signal" and rank == 1 and step >= 7)
    trainer = SimpleNamespace(world_size=2, global_rank=rank, strategy=SimpleNamespace(root_device="cpu"))
    try:
        for step in range(1, 200):
            if case != "superseded" and rank == 0 and step == 4:
                flag.signum = signal.SIGUSR2  # what the handler sets
            time.sleep(0.01)  # a 10 ms step: the ranks compare flags every 10 steps (AGREE_S)
            verdict = agreement.check(trainer, step)
            if verdict:
                return step, verdict
        return None, None
    finally:
        agreement.finish()


@pytest.mark.parametrize(("case", "verdict"), [
    ("signal", STOP),  # rank 0 alone is signalled at step 4
    ("superseded", SUPERSEDED),  # rank 1 alone reads another job's id from step 7 on
    ("both", SUPERSEDED),  # a superseded job writes nothing, not even the signal's checkpoint
])
def test_every_rank_stops_at_the_same_step(case: str, verdict: str) -> None:
    got = on_two_ranks(_agree, case)
    assert got[0] == got[1], got
    step, v = got[0]
    assert v == verdict and isinstance(step, int) and step <= 7 + 2 * 10 + 2, got  # within two intervals
