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
RESTART_STRIDE = 997  # an in-job restart's ports: this many jobs' further on (the last ones may be in TIME_WAIT)
STEP_NODES_ENV = "RUNNER_STEP_NODES"  # the nodes of this attempt's training step (a job's spares left out), "a,b"
AGAIN = 10  # the exit hook's answer to the batch script (resume.in_job): train again in this job


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0 listens: Lightning's (torch.distributed's) store on ``port``, the preflight's on its own port
    (ranks that finish the preflight early never reach a preflight store that is closing)."""

    addr: str
    port: int
    preflight_port: int

    @classmethod
    def of_job(cls, first_node: str, job_id: int, restart: int = 0) -> Rendezvous:
        """A Slurm job's: the first node of its step, ports derived from its id (two jobs sharing a node rarely
        collide, and a requeued job keeps its ports) and from its in-job ``restart`` (the previous attempt's port
        may still be in TIME_WAIT on that node)."""
        port = FIRST_PORT + 2 * ((job_id + RESTART_STRIDE * restart) % PORT_SPAN)
        return cls(first_node, port, port + 1)


def attempt_env(run_dir: Path, attempt: int, at: Rendezvous) -> dict[str, str]:
    """What every rank of one attempt shares."""
    return {"MASTER_ADDR": at.addr, "MASTER_PORT": str(at.port), "RUNNER_PREFLIGHT_PORT": str(at.preflight_port),
            "RUNNER_RUN_DIR": str(run_dir), ATTEMPT_ENV: str(attempt)}


def standby_env(nodes: list[str], per_node: int, node: str, local: int) -> dict[str, str] | None:
    """What makes a task of resume.in_job's warm standby step (on ``node``, ``local`` among its tasks there; the step
    spans the job's nodes) a rank of the attempt whose step is ``nodes`` (``per_node`` ranks each, in node order):
    Slurm's variables as srun sets them for a step of exactly those nodes (``runner.job.jobenv`` and Lightning's
    ``SLURMEnvironment`` read them). None: the task's node does not train in the attempt (a spare, a hang's node)."""
    if node not in nodes or not 0 <= local < per_node:
        return None
    index, world, listed = nodes.index(node), len(nodes) * per_node, ",".join(nodes)
    return {"SLURM_PROCID": str(index * per_node + local), "SLURM_NODEID": str(index), "SLURM_NTASKS": str(world),
            "SLURM_NPROCS": str(world), "SLURM_NNODES": str(len(nodes)), "SLURM_STEP_NUM_NODES": str(len(nodes)),
            "SLURM_STEP_NUM_TASKS": str(world), "SLURM_NODELIST": listed, "SLURM_STEP_NODELIST": listed,
            "SLURM_TASKS_PER_NODE": f"{per_node}(x{len(nodes)})",
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{len(nodes)})"}


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


# `fabric run`'s options (lightning/fabric/cli.py): those that tell Fabric how to train, as the variables cli.py sets
# (``_set_env_variables``), and those of its torchrun launch, which runner's own start of the ranks replaces.
FABRIC_SETTINGS = {"--accelerator": "LT_ACCELERATOR", "--strategy": "LT_STRATEGY", "--devices": "LT_DEVICES",
                   "--num-nodes": "LT_NUM_NODES", "--num_nodes": "LT_NUM_NODES", "--precision": "LT_PRECISION"}
FABRIC_LAUNCHER = ("--node-rank", "--node_rank", "--main-address", "--main_address", "--main-port", "--main_port")


@dataclass(frozen=True)
class FabricRun:
    """``fabric run [OPTIONS] SCRIPT [ARGS]`` read as its CLI (click) reads it: known options before or after SCRIPT
    (``--opt V`` or ``--opt=V``), everything after ``--`` and every other argument the script's; the first of those
    is SCRIPT. ``settings``: the ``LT_*`` variables its options set, ``LT_CLI_USED`` among them."""

    script: list[str]  # SCRIPT and its arguments; empty when none was given
    settings: dict[str, str]

    def disagrees(self, per_node: int, nodes: int) -> list[tuple[str, str, int]]:
        """The options that name another world than runner's: (option, its value, runner's)."""
        wrong = []
        for option, key, want in (("--devices", "LT_DEVICES", per_node), ("--num-nodes", "LT_NUM_NODES", nodes)):
            if key in self.settings and self.settings[key].strip() != str(want):
                wrong.append((option, self.settings[key], want))
        return wrong


def fabric_run(argv: list[str]) -> FabricRun | None:
    """The program of a ``fabric run ...`` command (None for any other command), which runner starts itself on each
    rank: ``python SCRIPT ARGS`` with the variables ``fabric run`` would set. An option it leaves out is runner's
    world (``LT_DEVICES``, ``LT_NUM_NODES`` from ``rank_env``) rather than its launcher's default of one device."""
    if len(argv) < 2 or Path(argv[0]).name != "fabric" or argv[1] != "run":
        return None
    settings: dict[str, str] = {"LT_CLI_USED": "1"}
    script: list[str] = []
    i = 2
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if arg == "--":
            script += argv[i + 1:]
            break
        if name in FABRIC_SETTINGS or name in FABRIC_LAUNCHER:
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else ""
            if name in FABRIC_SETTINGS:
                settings[FABRIC_SETTINGS[name]] = value
        else:
            script.append(arg)
        i += 1
    return FabricRun(script, settings)
