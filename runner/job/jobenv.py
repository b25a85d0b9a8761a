"""What the process that started a rank (srun, the local driver, runner's program runner) told it in its environment,
read once per process: ``JobEnv`` is the reading side of ``runner.world``'s builders.

Standard library only: the launcher reads it before torch is imported.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass

from runner import slurmstates
from runner.rundir import ATTEMPT_ENV
from runner.world import Rendezvous

PROGRAM_ENV = "RUNNER_PROGRAM_RUN_DIR"  # set by the launcher for a program (command:): the run directory


@dataclass(frozen=True)
class JobEnv:
    """One rank's place in the job, its job and its attempt."""

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    job_id: str | None  # the Slurm job as the run records it (slurmstates.job_id); None in a local run
    restart_count: str  # Slurm's requeues of the job, as Slurm says it ("0" before any): recorded and compared
    attempt: int | None  # RUNNER_ATTEMPT: the attempt whoever started the rank claims (None: not said)
    under_slurm: bool  # a task of an srun step (not an interactive allocation's shell)
    rendezvous: Rendezvous  # rank 0's stores (the defaults where nobody said: one machine)

    @classmethod
    def read(cls, env: Mapping[str, str]) -> JobEnv:
        """From srun's variables where it set them, else torchrun's (the local driver's, ``world.rank_env``)."""
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            place = (int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env.get("SLURM_NODEID", 0)),
                     int(env["SLURM_NTASKS"]))
        else:
            place = (int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("NODE_RANK", 0)),
                     int(env.get("WORLD_SIZE", 1)))
        attempt = env.get(ATTEMPT_ENV, "")
        port = int(env.get("MASTER_PORT", "29500"))
        return cls(*place, job_id=slurmstates.job_id(env), restart_count=env.get("SLURM_RESTART_COUNT", "0"),
                   attempt=int(attempt) if attempt.isdigit() else None,
                   under_slurm="SLURM_PROCID" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"),
                   rendezvous=Rendezvous(env.get("MASTER_ADDR", "127.0.0.1"), port,
                                         int(env.get("RUNNER_PREFLIGHT_PORT", port + 1))))

    def ranks(self) -> tuple[int, int, int, int]:
        """(global rank, local rank, node rank, world size)."""
        return self.rank, self.local_rank, self.node_rank, self.world_size


@functools.cache
def current() -> JobEnv:
    """This process's, read at first use: whoever starts a rank sets these before it starts, and nothing in the rank
    changes them (a program's torchrun variables, set by ``runner.job.program``, say the same)."""
    return JobEnv.read(os.environ)


def program_run_dir() -> str | None:
    """The run a program's Trainer belongs to: set by this very process (``runner.job.program``) after it started,
    so read when asked, never cached."""
    return os.environ.get(PROGRAM_ENV) or None
