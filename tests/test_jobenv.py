"""A rank's environment read once (runner.job.jobenv.JobEnv): srun's variables first, torchrun's otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.job.jobenv import JobEnv
from runner.world import Rendezvous, attempt_env, rank_env, standby_env

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("env", "expected"), [
    ({}, ((0, 0, 0, 1), None, "0", None, False)),  # started by hand: one rank, no job, no attempt said
    ({**rank_env(3, 1, 1, 4, 2, attempt=2, max_restarts=3, run_id="r", inherited={}), "RUNNER_ATTEMPT": "2"},
     ((3, 1, 1, 4), None, "0", 2, False)),  # the local driver
    ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "41",
      "SLURM_RESTART_COUNT": "1", "SLURM_JOB_NAME": "train", "RANK": "0", "WORLD_SIZE": "1", "RUNNER_ATTEMPT": "x"},
     ((5, 1, 2, 8), "41", "1", None, True)),  # srun's task ids win over torchrun's; a bad attempt is not said
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "interactive"},
     ((0, 0, 0, 1), None, "0", None, False)),  # an interactive allocation's shell is no srun step
])
def test_the_environment_a_rank_starts_with(env: dict[str, str], expected: tuple[object, ...]) -> None:
    got = JobEnv.read(env)
    assert (got.ranks(), got.job_id, got.restart_count, got.attempt, got.under_slurm) == expected


def test_the_rendezvous_is_the_one_the_builders_give() -> None:
    at = Rendezvous.of_job("node1", 41)
    assert JobEnv.read(attempt_env(Path("/runs/r"), 1, at)).rendezvous == at
    assert JobEnv.read({"MASTER_PORT": "12000"}).rendezvous == Rendezvous("127.0.0.1", 12000, 12001)


# A warm standby step's task (runner.job.standby: the step spans n1, n2, n3 with 2 tasks each) becomes the rank srun
# would have started on its node for a step of exactly the attempt's nodes; a task of a node left out exits.
STANDBY = [  # (the attempt's nodes, the task's node and local rank) -> (rank, local, node rank, world), or None
    (["n1", "n2"], "n1", 0, (0, 0, 0, 4)),
    (["n1", "n2"], "n2", 1, (3, 1, 1, 4)),
    (["n1", "n3"], "n3", 0, (2, 0, 1, 4)),  # the spare in n2's place: node rank 1
    (["n1", "n3"], "n2", 1, None),  # a hang's node: steps aside
    (["n2"], "n2", 1, (1, 1, 0, 2)),
    (["n1", "n2"], "n1", 2, None),  # more tasks per node than ranks
]


@pytest.mark.parametrize(("nodes", "node", "local", "expected"), STANDBY)
def test_a_standby_task_becomes_the_rank_of_its_node(nodes: list[str], node: str, local: int,
                                                     expected: tuple[int, ...] | None) -> None:
    place = standby_env(nodes, 2, node, local)
    if expected is None:
        assert place is None
        return
    assert place is not None
    job = {"SLURM_PROCID": "4", "SLURM_NODEID": "2", "SLURM_NTASKS": "6", "SLURM_LOCALID": str(local),
           "SLURM_JOB_ID": "41", "SLURM_JOB_NAME": "train"}  # the standby step's own ids, overridden
    got = JobEnv.read({**job, **place})
    assert got.ranks() == expected and got.under_slurm
    assert place["SLURM_NNODES"] == str(len(nodes)) and place["SLURM_STEP_NODELIST"] == ",".join(nodes)
