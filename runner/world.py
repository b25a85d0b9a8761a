"""Where a rank stands in the world, as the environment variables it starts with: one builder for every way runner
starts ranks.

An attempt's variables (the rendezvous, the run directory, the attempt number) are the same for all its ranks: a
local run's driver sets them for each rank it starts, a Slurm job's ``begin`` hook hands them to the batch script,
whose srun passes them on. A rank's own variables are torchrun's names for its place: the local driver sets them,
under srun each rank maps Slurm's task ids to them (``runner.job.program``). The login node, the batch host and the
ranks import this module; it needs nothing but the standard library and the run directory's names.
"""

from __future__ import annotations

from collections.abc import Mapping
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


ROLE = "default"  # torchrun's --role default: every rank has one role, so its role ranks are its ranks
FABRIC_ENV = ("LT_DEVICES", "LT_NUM_NODES")  # `fabric run`'s: an unedited ``Fabric()`` trains the world runner started


def rank_env(rank: int, local: int, node: int, world: int, per_node: int, *, attempt: int, max_restarts: int,
             run_id: str | None, inherited: Mapping[str, str]) -> dict[str, str]:
    """What a launcher tells one rank of ``world`` (``per_node`` on each node): every variable torchrun's agent
    sets its workers (``torch.distributed.elastic.agent.server.local_elastic_agent``, ``_start_workers``; but
    MASTER_ADDR and MASTER_PORT, which are the attempt's), runner's ``NODE_RANK`` (Lightning's own environment reads
    it) and ``fabric run``'s world (``FABRIC_ENV``: without them ``Fabric()`` trains one device per process).

    ``run_id`` is ``TORCHELASTIC_RUN_ID``, by which Lightning, Fabric and torch (``is_torchelastic_launched``) know
    torchrun started the process; None leaves it out: under srun, where Slurm's variables are the launcher's and
    Lightning's ``SLURMEnvironment`` must be the one chosen (its order puts torchelastic first). Each attempt is one
    restart of torchrun's worker group (``TORCHELASTIC_RESTART_COUNT``: attempts before this one); there is no
    agent's store (rank 0's ``init_process_group`` hosts it: ``TORCHELASTIC_USE_AGENT_STORE=False``).
    """
    env = {"RANK": str(rank), "LOCAL_RANK": str(local), "NODE_RANK": str(node), "GROUP_RANK": str(node),
           "ROLE_RANK": str(rank), "ROLE_NAME": ROLE, "LOCAL_WORLD_SIZE": str(per_node), "WORLD_SIZE": str(world),
           "GROUP_WORLD_SIZE": str(-(-world // per_node)), "ROLE_WORLD_SIZE": str(world),
           "TORCHELASTIC_RESTART_COUNT": str(max(attempt - 1, 0)), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
           "TORCHELASTIC_USE_AGENT_STORE": str(False),
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": inherited.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
           "LT_DEVICES": str(per_node), "LT_NUM_NODES": str(-(-world // per_node))}
    if run_id is not None:
        env["TORCHELASTIC_RUN_ID"] = run_id
    return env
