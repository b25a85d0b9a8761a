"""torchrun's contract, whole (runner.world.rank_env): every variable torch's elastic agent gives its workers, checked
against torch's own source (what Lightning and Fabric make of them: tests/test_world_local.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from runner.world import fabric_run, rank_env

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("place", "attempt", "run_id", "inherited", "expected"), [
    ((0, 0, 0, 2, 2), 1, "pm-1", {}, {  # a local run of 2 processes, its first attempt
        "RANK": "0", "LOCAL_RANK": "0", "NODE_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "2",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "pm-1",
        "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "LT_DEVICES": "2",
        "LT_NUM_NODES": "1"}),
    ((5, 1, 2, 8, 2), 3, None, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, {  # under srun, the third attempt
        "RANK": "5", "LOCAL_RANK": "1", "NODE_RANK": "2", "GROUP_RANK": "2", "ROLE_RANK": "5", "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "4", "ROLE_WORLD_SIZE": "8",
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "LT_DEVICES": "2", "LT_NUM_NODES": "4"}),
], ids=["local", "srun"])
def test_every_rank_gets_torchruns_variables(place: tuple[int, int, int, int, int], attempt: int, run_id: str | None,
                                            inherited: dict[str, str], expected: dict[str, str]) -> None:
    rank, local, node, world, per_node = place
    assert rank_env(rank, local, node, world, per_node, attempt=attempt, max_restarts=3, run_id=run_id,
                    inherited=inherited) == expected


def test_the_names_are_the_ones_torchs_agent_sets() -> None:
    """Read from the installed torch, not from memory: each key of ``_start_workers``' worker_env (and LOCAL_RANK,
    which it sets apart) is given, but the rendezvous (the attempt's, ``world.attempt_env``)."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    agent = Path(spec.origin).parent / "distributed" / "elastic" / "agent" / "server" / "local_elastic_agent.py"
    source = agent.read_text()  # not imported: its import starts a process (ldconfig)
    body = source[source.index("def _start_workers"):]
    body = body[body.index("worker_env = {"):]
    torch_keys = set(re.findall(r'^\s+"([A-Z_]+)":', body[:body.index("}")], re.M)) | {"LOCAL_RANK"}
    assert len(torch_keys) > 10
    ours = rank_env(0, 0, 0, 2, 2, attempt=1, max_restarts=3, run_id="r", inherited={})
    assert torch_keys - set(ours) == {"MASTER_ADDR", "MASTER_PORT"}


FABRIC_RUNS = [  # a `fabric run` command: (SCRIPT and its arguments, the LT_* variables its options set)
    (["fabric", "run", "train.py"], ["train.py"], {}),
    (["fabric", "run", "--devices", "2", "train.py", "--epochs", "3"], ["train.py", "--epochs", "3"],
     {"LT_DEVICES": "2"}),
    (["fabric", "run", "--devices=2", "train.py", "--epochs=3", "--num_nodes", "2", "--main-port", "5"],
     ["train.py", "--epochs=3"], {"LT_DEVICES": "2", "LT_NUM_NODES": "2"}),  # click's options after SCRIPT too
    (["fabric", "run", "train.py", "--", "--devices", "2"], ["train.py", "--devices", "2"], {}),
    (["/venv/bin/fabric", "run", "--accelerator", "cpu", "--strategy", "ddp", "--precision", "bf16-mixed",
      "--node-rank", "1", "train.py", "x"], ["train.py", "x"],
     {"LT_ACCELERATOR": "cpu", "LT_STRATEGY": "ddp", "LT_PRECISION": "bf16-mixed"}),
]


@pytest.mark.parametrize(("argv", "script", "settings"), FABRIC_RUNS)
def test_fabric_run_gives_its_script_and_variables(argv: list[str], script: list[str],
                                                    settings: dict[str, str]) -> None:
    """(The real CLI reads them alike: tests/test_world_local.py.)"""
    got = fabric_run(argv)
    assert got is not None and got.script == script and got.settings == {"LT_CLI_USED": "1", **settings}


@pytest.mark.parametrize(("argv", "wrong"), [
    (["fabric", "run", "train.py"], []),
    (["fabric", "run", "--devices", "2", "--num-nodes=1", "train.py"], []),
    (["fabric", "run", "--devices", "4", "train.py", "--num_nodes", "3"],
     [("--devices", "4", 2), ("--num-nodes", "3", 1)]),
    (["fabric", "run", "--devices", "auto", "train.py"], [("--devices", "auto", 2)]),
])
def test_fabric_runs_world_must_be_runners(argv: list[str], wrong: list[tuple[str, str, int]]) -> None:
    got = fabric_run(argv)
    assert got is not None and got.disagrees(2, 1) == wrong


def test_other_commands_are_not_fabric_run() -> None:
    for argv in (["python", "train.py"], ["fabric"], ["fabric", "consolidate", "x"], ["myfabric", "run", "t.py"]):
        assert fabric_run(argv) is None
