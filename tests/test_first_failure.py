"""The first rank to fail, from srun's words, exit codes and crash records, before its peers' echoes (issue 31)."""

from __future__ import annotations

import signal

import pytest

from runner.alerts.causes import RankExit, first_failure, srun_exits

pytestmark = pytest.mark.unit

ECHO = {"type": "DistBackendError", "message": "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer",
        "frame": "torch/autograd/graph.py:829 in _engine_run_backward", "step": 12}
RAISED = {"type": "RuntimeError", "message": "injected fault at step 12", "frame": "example.py:136 in _inject",
          "step": 12}
# srun's output of the dev cluster when rank 3 on n2 was SIGKILLed (--kill-on-bad-exit then ends the rest).
SRUN = """\
srun: error: n2: task 3: Killed
srun: Job step aborted: Waiting up to 4 seconds for job step to finish.
slurmstepd: error: *** STEP 7.0 ON n1 CANCELLED AT 2026-11-25T00:40:01 ***
srun: error: n1: tasks 0-1: Exited with exit code 1
srun: error: n2: task 2: Killed
""".splitlines()


def test_srun_lines_name_tasks_nodes_and_how() -> None:
    exits = srun_exits(SRUN)
    assert [(e.rank, e.node, e.code) for e in exits] == [(3, "n2", -signal.SIGKILL), (0, "n1", 1), (1, "n1", 1),
                                                        (2, "n2", -signal.SIGKILL)]


def test_the_killed_rank_is_the_cause_before_the_peers_echo() -> None:
    f = first_failure(srun_exits(SRUN), {0: ECHO, 1: ECHO})
    assert f is not None and f.cause == "rank 3 on n2: killed (srun: Killed)" and f.exit_code == 137


def test_an_exception_of_its_own_beats_an_earlier_echo() -> None:
    exits = [RankExit(0, 1, 1.0, "vm"), RankExit(1, 1, 2.0, "vm")]
    f = first_failure(exits, {0: ECHO, 1: RAISED})
    assert f is not None and f.rank == 1
    assert f.cause == "rank 1 on vm: Python exception: RuntimeError: injected fault at step 12 at example.py:136 in " \
                      "_inject, step 12"


def test_local_signals_orderly_exits_and_ranks_killed_after_the_failure() -> None:
    exits = [RankExit(1, -signal.SIGKILL, 1.0, "vm"), RankExit(0, 1, 2.0, "vm")]
    f = first_failure(exits, {0: ECHO})
    assert f is not None and f.cause == "rank 1 on vm: killed by SIGKILL" and f.exit_code == 137
    assert first_failure([RankExit(0, 75), RankExit(1, 0)], {}) is None  # a checkpoint on a signal, a finish
    hang = [RankExit(0, 79, 1.0, "vm"), RankExit(1, -signal.SIGKILL, 6.0, "vm")]
    f = first_failure(hang, {}, killed={1})  # the driver killed the stopped rank: not the cause
    assert f is not None and f.rank == 0 and f.exit_code == 79
    only_echoes = first_failure([RankExit(0, 1, 1.0, "vm")], {0: ECHO})
    assert only_echoes is not None and only_echoes.cause.startswith("rank 0 on vm: exit 1 after DistBackendError")
