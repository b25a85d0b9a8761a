"""A Lightning program's own bookkeeping after a stop or a crash, under `runner submit` and `runner resume`: Lightning's
transformer example with its own `ModelCheckpoint(monitor="val_loss", save_last=True)`, a validation each epoch and
work at each epoch's end (tests/programs/lightning_transformer.py; 1 rank, 3 epochs of 16 steps, the tests' batch log
beside it: tests/programs/batchlog.py). Stopped by the notice mid-epoch, then at an epoch's last step, then left to
finish, it ends as a run nobody stopped: each epoch validated and ended once, its checkpoints named as that run's,
`last.ckpt` the newest, each batch of each epoch trained once (its DataLoader under Lightning's DistributedSampler is
replayed to the stop's batch), the same weights. A rank killed after an epoch's end leaves no `last-v1.ckpt`. With
the DataLoader's own RandomSampler (no order to replay), a stop mid-epoch resumes from the epoch's start, which trains
the epoch once, to the same weights."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from runner import checkpoint
from runner.rundir import EXIT_REQUEUE, RunDir
from tests.conftest import fixture_tier
from tests.waiting import until

pytestmark = pytest.mark.local
PROGRAMS = Path(__file__).resolve().parent / "programs"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
EPOCH = 16  # steps an epoch: 64 samples, batches of 4, 1 rank
CONF = """\
num_nodes: 1
num_device: 1
command: python train.py --devices ${{num_device}} --num_nodes ${{num_nodes}} --samples 64 --log batches {more}
runner:
  name: stop
  scheduler: local
  container: {{runtime: none}}
  checkpoint: {{every_n_steps: {every}, keep_last: {keep}}}
"""


def prepare(where: Path, more: str = "", every: int = EPOCH, keep: int = 3) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(PROGRAMS / "lightning_transformer.py", where / "train.py")
    shutil.copy(PROGRAMS / "batchlog.py", where / "batchlog.py")
    (where / "conf.yaml").write_text(CONF.format(more=more, every=every, keep=keep))
    return where


def start(where: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "runner", *args], cwd=where, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def the_run(where: Path) -> RunDir:
    [run] = where.glob("runs/stop-*")
    return RunDir(run)


def stop_at(where: Path, proc: subprocess.Popen[str], step: int, attempt: int) -> None:
    """The preemption notice to `runner submit`/`resume` while the program waits before ``step`` (batchlog's pause):
    once the rank has it, the program trains that step and runner's agreed stop is there."""
    def paused() -> bool:
        assert proc.poll() is None, proc.communicate()[0]
        return (where / "batches" / f"paused-{step}").exists()

    until(f"the program paused before step {step}", paused, 120)
    proc.send_signal(signal.SIGUSR2)
    until("the rank to get the notice",
          lambda: "received SIGUSR2" in the_run(where).rank_log(0, attempt).read_text(), 60)
    (where / "batches" / f"go-{step}").touch()


def finish(proc: subprocess.Popen[str], code: int) -> str:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == code, out
    return out


def trained(where: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (where / "batches" / "rank-0.jsonl").read_text().splitlines()]


def own_checkpoints(where: Path) -> set[str]:
    return {p.name for p in (where / "checkpoints-own").iterdir()}


def epoch_ends(run: RunDir) -> list[str]:
    """The program's own line at each epoch's end, in every attempt's rank log."""
    return [line for log in sorted(run.root.glob("logs/attempt-*/rank-00000.log"))
            for line in re.findall(r"^epoch \d+ ended at step \d+$", log.read_text(), re.M)]


def final_weights(run: RunDir) -> dict[str, torch.Tensor]:
    return torch.load(run.final / "rank-00000.pt", weights_only=True)


@pytest.fixture(scope="module")
@fixture_tier("local")
def unstopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = prepare(tmp_path_factory.mktemp("unstopped"))
    finish(start(where, "submit", "conf.yaml"), 0)
    return where


def test_a_stop_mid_epoch_and_one_at_an_epochs_end_leave_the_programs_bookkeeping_as_an_unstopped_runs(
        tmp_path: Path, unstopped: Path) -> None:
    where = prepare(tmp_path, f"--pause-at {EPOCH + 5} {2 * EPOCH}")
    proc = start(where, "submit", "conf.yaml")
    stop_at(where, proc, EPOCH + 5, 1)  # mid-epoch 1
    finish(proc, EXIT_REQUEUE)
    run = the_run(where)
    proc = start(where, "resume", str(run.root))
    stop_at(where, proc, 2 * EPOCH, 2)  # epoch 1's last step: the stop waits for its validation and its end
    finish(proc, EXIT_REQUEUE)
    finish(start(where, "resume", str(run.root)), 0)

    resumed = [e for e in run.events() if e["event"] == "resumed"]
    assert [(e["step"], e["mid_epoch"], e["data_exact"], e["trajectory"]) for e in resumed] == \
        [(EPOCH + 5, True, True, "bitwise"), (2 * EPOCH, False, True, "bitwise")], resumed
    assert "the epoch's pass replayed to that batch" in resumed[0]["data"]
    # No validation, epoch end or checkpoint of the partial epoch; epoch 1's end not skipped by the stop on its last
    # step: the program's own files and lines are the unstopped run's.
    assert epoch_ends(run) == [f"epoch {e} ended at step {(e + 1) * EPOCH}" for e in range(3)]
    assert own_checkpoints(where) == own_checkpoints(unstopped), "the program's ModelCheckpoint files differ"
    last = torch.load(where / "checkpoints-own" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 3 * EPOCH  # the newest weights, not a stopped attempt's
    # Each batch of each epoch trained once, in the unstopped run's order, to the same weights.
    batches = trained(where)
    assert [(b["epoch"], b["held"]) for b in batches] == [(b["epoch"], b["held"]) for b in trained(unstopped)]
    assert max(Counter((b["epoch"], json.dumps(b["held"])) for b in batches).values()) == 1
    mine, theirs = final_weights(run), final_weights(the_run(unstopped))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), "not bitwise equal"


def test_a_rank_killed_after_an_epochs_end_leaves_no_second_last_checkpoint(tmp_path: Path,
                                                                             unstopped: Path) -> None:
    """Killed at the first step after epoch 0's end, whose ModelCheckpoint saves came after runner's checkpoint of that
    step was due: the resume starts from a checkpoint that holds those saves, so the program keeps one `last.ckpt`,
    its newest, and a best checkpoint it knows of (Lightning writes `last-v1.ckpt` beside a `last.ckpt` its restored
    state does not name)."""
    where = prepare(tmp_path, f"--pause-at {EPOCH + 1} --kill-at {EPOCH + 1}")
    proc = start(where, "submit", "conf.yaml")
    until("the program paused before the epoch's second step", lambda: (where / "batches" / f"paused-{EPOCH + 1}")
          .exists() and checkpoint.complete(the_run(where).checkpoints), 120)
    (where / "batches" / f"go-{EPOCH + 1}").touch()  # killed, once runner's checkpoint of epoch 0 is complete
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0 and (where / "batches" / f"killed-{EPOCH + 1}").exists(), out
    run = the_run(where)
    finish(start(where, "resume", str(run.root)), 0)
    assert [e["step"] for e in run.events() if e["event"] == "resumed"] == [EPOCH]
    assert own_checkpoints(where) == own_checkpoints(unstopped), "the program's ModelCheckpoint files differ"
    last = torch.load(where / "checkpoints-own" / "last.ckpt", weights_only=False)
    assert last["global_step"] == 3 * EPOCH
    assert epoch_ends(run) == [f"epoch {e} ended at step {(e + 1) * EPOCH}" for e in range(3)]


@pytest.fixture(scope="module")
@fixture_tier("local")
def unstopped_random(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = prepare(tmp_path_factory.mktemp("unstopped_random"), "--random-sampler")
    finish(start(where, "submit", "conf.yaml"), 0)
    return where


def test_a_loader_that_cannot_be_positioned_resumes_from_its_epochs_start_and_trains_the_epoch_once(
        tmp_path: Path, unstopped_random: Path) -> None:
    """A RandomSampler draws its epoch's order when the epoch starts: stopped mid-epoch 1, the run resumes from runner's
    checkpoint of epoch 0's end (kept for it, every_n_steps apart), passing over the stop's, and trains epoch 1 whole,
    in the order the unstopped run drew (its pass made from the checkpoint's RNG)."""
    where = prepare(tmp_path, f"--random-sampler --pause-at {EPOCH + 5}", every=6, keep=2)
    proc = start(where, "submit", "conf.yaml")
    stop_at(where, proc, EPOCH + 5, 1)
    finish(proc, EXIT_REQUEUE)
    run = the_run(where)
    # The newest 2 and, beyond them, epoch 0's end (written for this loader, kept by prune).
    assert [step for step, _ in checkpoint.complete(run.checkpoints)] == [EPOCH + 5, 18, EPOCH]
    finish(start(where, "resume", str(run.root)), 0)

    [said] = [e for e in run.events() if e["event"] == "resumed"]
    assert (said["step"], said["mid_epoch"], said["data_exact"]) == (EPOCH, False, True), said
    assert f"the newer checkpoint of step {EPOCH + 5}, mid-epoch, was passed over" in said["data"], said
    [again] = [e for e in run.events() if e["event"] == "train_start" and e["attempt"] == 2]
    assert (again["step"], again["lost_steps"]) == (EPOCH, 5), again
    batches, reference = trained(where), trained(unstopped_random)
    first, second = batches[:EPOCH + 5], batches[EPOCH + 5:]  # the stopped attempt's, the resumed one's
    assert [(b["step"], b["held"]) for b in first] == [(b["step"], b["held"]) for b in reference[:EPOCH + 5]]
    assert [(b["step"], b["held"]) for b in second] == [(b["step"], b["held"]) for b in reference[EPOCH:]]
    mine, theirs = final_weights(run), final_weights(the_run(unstopped_random))
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), "not bitwise equal"
