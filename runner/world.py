"""Where a rank stands in the world, as the environment variables it starts with: one builder for every way runner
starts ranks.

An attempt's variables (the rendezvous, the run directory, the attempt number) are the same for all its ranks: a
local run's driver sets them for each rank it starts, a Slurm job's ``begin`` hook hands them to the batch script,
whose srun passes them on. A rank's own variables are torchrun's names for its place: the local driver sets them,
under srun each rank maps Slurm's task ids to them (``runner.job.program``). The login node, the batch host and the
ranks import this module; it needs nothing but the standard library and the run directory's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner.rundir import ATTEMPT_ENV

FIRST_PORT = 10000  # a Slurm job's ports: below the ephemeral range, two per job id modulo PORT_SPAN
PORT_SPAN = 10000


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0 listens: Lightning's (torch.distributed's) store on ``port``, the preflight's on its own port
    (ranks that finish the preflight early never reach a preflight store that is closing)."""

    addr: str
    port: int
    preflight_port: int

    @classmethod
    def of_job(cls, first_node: str, job_id: int) -> Rendezvous:
        """A Slurm job's: its first node, ports derived from its id (two jobs sharing a node rarely collide, and a
        requeued job keeps its ports)."""
        port = FIRST_PORT + 2 * (job_id % PORT_SPAN)
        return cls(first_node, port, port + 1)


def attempt_env(run_dir: Path, attempt: int, at: Rendezvous) -> dict[str, str]:
    """What every rank of one attempt shares."""
    return {"MASTER_ADDR": at.addr, "MASTER_PORT": str(at.port), "RUNNER_PREFLIGHT_PORT": str(at.preflight_port),
            "RUNNER_RUN_DIR": str(run_dir), ATTEMPT_ENV: str(attempt)}


def rank_env(rank: int, world: int, per_node: int) -> dict[str, str]:
    """torchrun's variables for one rank of ``world``, ``per_node`` on each node."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "NODE_RANK": str(rank // per_node),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node)}
