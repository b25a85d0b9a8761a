"""What Lightning, Fabric and torch make of runner's world (runner.world.rank_env), in this process: locally
torchelastic's variables (Lightning's ``TorchElasticEnvironment``), under srun Slurm's (its ``SLURMEnvironment``).
Local tier: torch's elastic imports start ``ldconfig``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from runner.world import fabric_run, rank_env
from tests.test_world import FABRIC_RUNS

pytestmark = pytest.mark.local

SRUN = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "41",
        "SLURM_JOB_NAME": "train", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_NODELIST": "n[1-2]"}


def _env(monkeypatch: pytest.MonkeyPatch, srun: bool) -> None:
    for key in ("TORCHELASTIC_RUN_ID", "LT_CLI_USED", *SRUN):
        monkeypatch.delenv(key, raising=False)
    place = rank_env(3, 1, 1, 4, 2, attempt=1, max_restarts=3, run_id=None if srun else "pm-1", inherited={})
    for key, value in {**place, **(SRUN if srun else {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize(("srun", "environment"), [(False, "TorchElasticEnvironment"), (True, "SLURMEnvironment")],
                         ids=["local", "srun"])
def test_lightning_and_fabric_see_the_world_runner_started(monkeypatch: pytest.MonkeyPatch, srun: bool,
                                                           environment: str) -> None:
    """A program's own Trainer (its devices and num_nodes passed), an unedited ``Fabric()`` and torch see rank 3 of
    4: locally through torchelastic's variables, under srun through Slurm's (Lightning's ``SLURMEnvironment``, as
    before); runner's own Trainer names its environment itself."""
    import lightning as L
    import torch.distributed as dist
    from lightning.fabric import Fabric

    _env(monkeypatch, srun)
    assert dist.is_torchelastic_launched() is not srun
    fabric = Fabric(accelerator="cpu")
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    for strategy in (fabric.strategy, trainer.strategy):
        env = strategy.cluster_environment  # type: ignore[attr-defined]
        assert type(env).__name__ == environment
        assert (env.global_rank(), env.local_rank(), env.node_rank(), env.world_size()) == (3, 1, 1, 4)
    assert (fabric.world_size, fabric.global_rank, fabric.node_rank) == (4, 3, 1)


@pytest.mark.parametrize(("argv", "script", "settings"), FABRIC_RUNS)
def test_fabric_run_is_read_as_its_cli_reads_it(argv: list[str], script: list[str], settings: dict[str, str],
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """runner's reading of a ``fabric run`` command, and the real CLI's (Lightning's click command, its launch
    replaced): the same SCRIPT, arguments and variables."""
    from lightning.fabric import cli

    got = fabric_run(argv)
    assert got is not None and got.script == script and got.settings == {"LT_CLI_USED": "1", **settings}
    seen: dict[str, Any] = {}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").touch()
    monkeypatch.setattr(cli, "_torchrun_launch", lambda args, script_args: seen.update(
        script=[args.script, *script_args], env={k: v for k, v in os.environ.items() if k.startswith("LT_")}))
    for key in [k for k in os.environ if k.startswith("LT_")]:
        monkeypatch.delenv(key)
    cli._main(argv[1:], standalone_mode=False)
    defaults = {"LT_DEVICES": "1", "LT_NUM_NODES": "1"}  # fabric run's own; runner's world where left out
    assert seen == {"script": script, "env": {**defaults, **got.settings}}
