"""ESPnet3's own bookkeeping after a preemption, in its mini_an4 recipe (prepared by tests/test_espnet3.py's fixture):
`train` for 3 epochs of 16 steps (1 rank, no limit_train_batches), a USR2 notice landed mid-epoch and another on an
epoch's last step, each followed by `runner resume`. ESPnet3's `exp/` ends as an unpreempted run's: no validation or
best checkpoint of a partial epoch, every epoch's validation and `epoch_summary` once, `last.ckpt` the newest; its
loader (an EpochSyncIterator over espnet2's SequenceIterFactory, each epoch seeded by the epoch) is replayed to the
stop's batch, so each batch of each epoch is trained once (counted by tests/programs/batchlog.py, a callback ESPnet3
adds from its config) and the final weights are the unpreempted run's, bitwise."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from runner.rundir import EXIT_REQUEUE, RunDir
from tests import test_espnet3
from tests.conftest import fixture_tier
from tests.test_espnet3 import CONF, espnet3_python, local_env, one_run
from tests.waiting import until

pytestmark = pytest.mark.local
recipe = test_espnet3.recipe  # the fixture: the recipe prepared once a session
EPOCH = 16  # 32 training utterances (test_espnet3.REPEAT), 2 a batch, 1 rank
TRAIN = ["stages=train", "trainer.max_epochs=3", "trainer.limit_train_batches=null", "trainer.limit_val_batches=null"]


def start(recipe: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([str(espnet3_python()), "-m", "runner", *args], cwd=recipe, env=local_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def submit(recipe: Path, root: Path, tag: str, pause_at: list[int]) -> subprocess.Popen[str]:
    """`runner submit` of the train stage as ESPnet3's exp/<tag>, the batch log (and its pauses) in root/batches."""
    log = f"trainer.callbacks=[{{_target_: batchlog.BatchLog, out: {root / 'batches'}, pause_at: {pause_at}}}]"
    return start(recipe, "submit", CONF, f"runner.run_root={root / 'runs'}", *TRAIN, f"exp_tag={tag}", log)


def finish(proc: subprocess.Popen[str], code: int) -> None:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == code, out


def stop_at(root: Path, proc: subprocess.Popen[str], step: int, attempt: int) -> None:
    """The notice while ESPnet3's Trainer waits before ``step``: runner's agreed stop is that step."""
    def paused() -> bool:
        assert proc.poll() is None, proc.communicate()[0]
        return (root / "batches" / f"paused-{step}").exists()

    until(f"the training paused before step {step}", paused, 300)
    proc.send_signal(signal.SIGUSR2)
    run = RunDir(one_run(root / "runs"))
    until("the rank to get the notice", lambda: "received SIGUSR2" in run.rank_log(0, attempt).read_text(), 60)
    (root / "batches" / f"go-{step}").touch()


def trained(root: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / "batches" / "rank-0.jsonl").read_text().splitlines()]


def saved(exp: Path) -> set[str]:
    """ESPnet3's checkpoints and averaged models."""
    return {p.name for p in exp.iterdir() if p.suffix in (".ckpt", ".pth")}


def summaries(exp: Path) -> list[str]:
    """ESPnet3's epoch_summary lines (MetricsLogger) in every train*.log of the experiment (one a start: ESPnet3
    moves the previous train.log aside), sorted."""
    return sorted(m for log in exp.glob("train*.log")
                  for m in re.findall(r"epoch_summary:(\d+epoch:(?:train|valid))", log.read_text()))


def final_weights(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(RunDir(one_run(root / "runs")).final / "rank-00000.pt", weights_only=True)


@pytest.fixture(scope="module")
@fixture_tier("local")
def with_batchlog(recipe: Path) -> Path:
    """The recipe with the tests' batch log beside its run.py (ESPnet3 instantiates trainer.callbacks from there)."""
    shutil.copy(Path(__file__).parent / "programs" / "batchlog.py", recipe / "batchlog.py")
    return recipe


@pytest.fixture(scope="module")
@fixture_tier("local")
def unpreempted(with_batchlog: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("unpreempted")
    finish(submit(with_batchlog, root, "stop_ref", []), 0)
    return root


def test_a_preempted_recipe_ends_with_espnet3s_exp_and_weights_of_an_unpreempted_one(with_batchlog: Path,
                                                                                    unpreempted: Path,
                                                                                    tmp_path: Path) -> None:
    recipe = with_batchlog
    proc = submit(recipe, tmp_path, "stop_run", [EPOCH + 5, 2 * EPOCH])
    stop_at(tmp_path, proc, EPOCH + 5, 1)  # mid-epoch 1
    finish(proc, EXIT_REQUEUE)
    run = RunDir(one_run(tmp_path / "runs"))
    proc = start(recipe, "resume", str(run.root))
    stop_at(tmp_path, proc, 2 * EPOCH, 2)  # epoch 1's last step: the stop waits for its validation and its end
    finish(proc, EXIT_REQUEUE)
    finish(start(recipe, "resume", str(run.root)), 0)

    resumed = [e for e in run.events() if e["event"] == "resumed"]
    assert [(e["step"], e["mid_epoch"], e["data_exact"], e["trajectory"]) for e in resumed] == \
        [(EPOCH + 5, True, True, "bitwise"), (2 * EPOCH, False, True, "bitwise")], resumed
    exp, ref = recipe / "exp" / "stop_run", recipe / "exp" / "stop_ref"
    # No validation, best checkpoint or step checkpoint of the partial epoch (epoch1_step21_valid.loss.ckpt,
    # step21.ckpt), epoch 1's validation not skipped by the stop on its last step, no last-v1.ckpt.
    assert saved(exp) == saved(ref), "ESPnet3's checkpoints differ from the unpreempted run's"
    assert summaries(exp) == summaries(ref) == [f"{e}epoch:{part}" for e in (1, 2, 3) for part in ("train", "valid")]
    last = exp / "last.ckpt"
    assert last.resolve() == max(exp.glob("*.ckpt"), key=lambda p: p.stat().st_mtime).resolve()
    assert torch.load(last, weights_only=False)["global_step"] == 3 * EPOCH
    # Each batch of each epoch trained once, as the unpreempted run trained them, to its weights and averaged models.
    batches = trained(tmp_path)
    assert [(b["epoch"], b["held"]) for b in batches] == [(b["epoch"], b["held"]) for b in trained(unpreempted)]
    assert max(Counter((b["epoch"], json.dumps(b["held"])) for b in batches).values()) == 1
    mine, theirs = final_weights(tmp_path), final_weights(unpreempted)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), "not bitwise equal"
    for averaged in (p.name for p in ref.glob("*.pth")):
        a, b = torch.load(exp / averaged, weights_only=True), torch.load(ref / averaged, weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a), averaged
