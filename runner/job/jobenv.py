"""What the process that started a rank (srun, the local launcher, runner's program runner) told it in its
environment. Standard library only: the launcher reads it before torch is imported."""

from __future__ import annotations

import os

PROGRAM_ENV = "RUNNER_PROGRAM_RUN_DIR"  # set by the launcher for a program (command:): the run directory


def ranks() -> tuple[int, int, int, int]:
    """(global rank, local rank, node rank, world size) from srun's or the local launcher's variables."""
    env = os.environ
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return (int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env.get("SLURM_NODEID", 0)),
                int(env["SLURM_NTASKS"]))
    return int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("NODE_RANK", 0)), \
        int(env.get("WORLD_SIZE", 1))
