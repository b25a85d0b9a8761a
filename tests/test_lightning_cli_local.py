"""Lightning's LightningCLI example (tests/programs/lightning_cli_main.py, unedited) under `runner submit` with 2 real
processes, as its users run it: `command: python main.py fit --config ${program_config}` beside a config of
trainer:, model:, data:. It trains to the end with runner's checkpoints, and a preempted run resumed on 1 rank keeps
its global batch (accumulation 2). What the program's copy holds: tests/test_program_copy.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from runner import checkpoint
from runner.rundir import EXIT_REQUEUE, RunDir
from tests.waiting import until

pytestmark = pytest.mark.local
PROGRAMS = Path(__file__).resolve().parent / "programs"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# The config a LightningCLI user writes (`python main.py fit --print_config` gives its shape), with runner's keys:
# the layout at the top, runner's settings in a runner: block (model: and data: are the program's).
CONF = """\
command: python main.py fit --config ${program_config}
num_nodes: 1
num_device: 2
runner:
  name: cli
  scheduler: local
  checkpoint: {every_n_steps: EVERY}
seed_everything: 7
trainer:
  accelerator: cpu
  devices: ${num_device}
  num_nodes: ${num_nodes}
  max_steps: STEPS
  accumulate_grad_batches: 1
  enable_progress_bar: false
model:
  out_dim: 10
  learning_rate: 0.02
data: {}
"""


SLOW = """\
import time

import lightning as L


class Slow(L.Callback):
    def on_train_batch_end(self, *args):
        time.sleep(0.05)
"""


def submit(where: Path, steps: int, every: int, stop_after: int | None = None) -> tuple[int, str, RunDir]:
    """Write main.py and conf.yaml in ``where`` and run `runner submit conf.yaml` there; ``stop_after``: send it
    USR2 (a preemption notice) once the checkpoint at that step is complete, with steps slowed to 50 ms (a callback
    of the config's, as LightningCLI takes one) so that the stop lands within a few steps of it."""
    shutil.copy(PROGRAMS / "lightning_cli_main.py", where / "main.py")
    conf = CONF.replace("EVERY", str(every)).replace("STEPS", str(steps))
    if stop_after is not None:
        (where / "slow.py").write_text(SLOW)
        conf = conf.replace("  enable_progress_bar: false\n",
                            "  enable_progress_bar: false\n  callbacks: [{class_path: slow.Slow}]\n")
    (where / "conf.yaml").write_text(conf)
    proc = subprocess.Popen([sys.executable, "-m", "runner", "submit", "conf.yaml"], cwd=where, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if stop_after is not None:
        def complete() -> bool:
            if list(where.glob(f"runs/cli-*/checkpoints/step-{stop_after:07d}/COMPLETE")):
                return True
            assert proc.poll() is None, f"no checkpoint at step {stop_after}: the run ended"
            return False
        until(f"the checkpoint at step {stop_after}", complete, 120, every=0.02)
        proc.send_signal(signal.SIGUSR2)
    out, _ = proc.communicate(timeout=240)
    [run] = where.glob("runs/cli-*")
    return proc.returncode, out, RunDir(run)


def events(run: RunDir, name: str) -> list[dict[str, Any]]:
    return [e for e in run.events() if e["event"] == name]


def cli_config(where: Path, version: int) -> dict[str, Any]:
    """What LightningCLI itself parsed (its SaveConfigCallback's copy in the logger's directory): what it trained."""
    return yaml.safe_load((where / "lightning_logs" / f"version_{version}" / "config.yaml").read_text())


def test_the_lightning_cli_example_trains_to_the_end_with_runners_checkpoints(tmp_path: Path) -> None:
    code, out, run = submit(tmp_path, steps=40, every=10)
    assert code == 0, out
    assert "Expected a <class 'int'>" not in out and "is not accepted" not in out
    assert run.finished.exists() and [e["step"] for e in events(run, "finished")] == [40]
    # keep_last 3, and the newest at an epoch's end (32 steps an epoch): where a resume on another layout goes back
    # to, the loader (a DistributedSampler's) being replayed to a stop's batch on its own layout only
    assert [step for step, _ in checkpoint.complete(run.checkpoints)] == [40, 32, 30]
    assert all(checkpoint.verify(path) is None for _, path in checkpoint.complete(run.checkpoints))
    for rank in (0, 1):
        assert "Adding 1 callbacks from entry point 'runner'" in run.rank_log(rank).read_text()
    copy = yaml.safe_load(run.program_config("conf.yaml").read_text())
    assert set(copy) == {"seed_everything", "trainer", "model", "data"}  # runner's keys left out
    parsed = cli_config(tmp_path, 0)
    assert (parsed["trainer"]["devices"], parsed["trainer"]["num_nodes"]) == (2, 1)  # integers, as it trained
    assert parsed["seed_everything"] == 7 and parsed["model"]["learning_rate"] == 0.02


def test_preempted_it_resumes_on_one_rank_with_the_same_global_batch(tmp_path: Path) -> None:
    """Stopped mid-epoch on 2 ranks, resumed on 1 with accumulation 2. Its BoringDataModule's DataLoader, under
    Lightning's DistributedSampler, is replayed to a stop's batch on the layout that wrote the checkpoint only: on 1
    rank the epoch's shares are other samples, so the resume goes back to the checkpoint runner wrote at the epoch's
    end (step 96: 64 samples, batch 1, 32 steps an epoch on 2 ranks) and trains the interrupted epoch again, each
    batch once, and the `resumed` record says so (was: it continued Lightning's per-rank count, part of the epoch
    trained twice and part never)."""
    code, out, run = submit(tmp_path, steps=160, every=50, stop_after=100)
    assert code == EXIT_REQUEUE, out
    newest, path = checkpoint.complete(run.checkpoints)[0]
    assert 100 < newest < 128 and not run.finished.exists()
    epoch_end = checkpoint.CheckpointDir(run.checkpoints).step(96)
    assert checkpoint.manifest_of(path)["position"] == "replayed" and checkpoint.manifest_of(epoch_end)["mid_epoch"] \
        is False
    resized = subprocess.run([sys.executable, "-m", "runner", "resume", str(run.root), "num_device=1"],
                             capture_output=True, text=True, env=ENV, timeout=240)
    assert resized.returncode == 0, resized.stdout + resized.stderr
    assert "resized from 1x2 (accumulate 1) to 1x1 (accumulate 2)" in resized.stdout, resized.stdout
    assert [(e["world_size"], e["accumulate"]) for e in events(run, "resized")] == [(1, 2)]
    copy = yaml.safe_load(run.program_config("conf.yaml").read_text())
    assert "num_nodes" not in copy and "num_device" not in copy  # LightningCLI would refuse them
    assert {k: copy["trainer"][k] for k in ("devices", "num_nodes", "accumulate_grad_batches")} == \
        {"devices": 1, "num_nodes": 1, "accumulate_grad_batches": 2}
    parsed = cli_config(tmp_path, 1)  # the second attempt's: 1 rank x 2 batches per step, as 2 ranks x 1 were
    assert (parsed["trainer"]["devices"], parsed["trainer"]["accumulate_grad_batches"]) == (1, 2)
    start = [e for e in events(run, "train_start") if e["attempt"] == 2]
    assert [(e["step"], e["resumed_from"]) for e in start] == [(96, str(epoch_end))]
    [r] = events(run, "resumed")
    assert (r["step"], r["from_world"], r["to_world"], r["mid_epoch"]) == (96, 2, 1, False), r
    assert (r["partial_epoch"], r["steps_again"], r["data_exact"]) == ("restarted", newest - 96, True), r
    assert f"the newer checkpoint of step {newest}, mid-epoch, was passed over: the loader is replayed to a batch " \
        "only on the layout that wrote it (2 ranks), not on 1, so the interrupted epoch is trained again from its " \
        f"start, each batch once ({newest - 96} steps again)" in r["data"], r
    assert run.finished.exists() and [e["step"] for e in events(run, "finished")] == [160]
    assert not run.rank_log(1, 2).exists()  # one rank in the second attempt
