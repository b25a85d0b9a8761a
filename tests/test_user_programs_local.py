"""Programs as their communities write them (tests/programs/: PyTorch's torchrun tutorial script with its own snapshot
and SIGTERM handler, an Accelerate script; none imports runner) under `runner submit` with 2 local processes and
``runtime: none``: each trains one world (rank ids; different losses on different
shards, equal weights after every all-reduced step), Ctrl-C stops it within seconds as ``interrupted``, a preemption
notice reaches the torchrun script's own SIGTERM handler, whose snapshot the resumed attempt starts from, and a
single-process script started on 2 ranks stops at its first step with one line and exit 81."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from runner.rundir import EXIT_PROGRAM, EXIT_REQUEUE, RunDir
from tests.waiting import until

pytestmark = pytest.mark.local
PROGRAMS = Path(__file__).resolve().parent / "programs"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
CONF = """\
num_nodes: 1
num_device: 2
runner:
  name: up
  scheduler: local
  container: {runtime: none}
"""
TORCHRUN = "python ddp_multinode.py {epochs} 1 --batch_size 8 --sleep {sleep}"
ACCELERATE = "python accelerate_regression.py --cpu --num_epochs {epochs} --sleep {sleep}"
# One line per optimizer step and rank, in each program's own words: (step key, rank, loss, weights).
LINES = {
    "torchrun": re.compile(r"^\[RANK(\d)\] epoch (\d+) batch (\d+) loss (\S+) weights (\S+)$", re.M),
    "accelerate": re.compile(r"^epoch (\d+) step (\d+) process (\d) loss (\S+) weights (\S+)$", re.M),
}


def submit(where: Path, command: str, interrupt: int | None = None) -> tuple[int, str, RunDir, float]:
    """``command`` from conf.yaml in ``where`` (the programs copied beside it), by `runner submit` there: its exit code,
    output, run and the seconds from ``interrupt`` (sent to `runner submit` once rank 0 trained a few steps) to its
    end."""
    for program in PROGRAMS.glob("*.py"):
        shutil.copy(program, where / program.name)
    (where / "conf.yaml").write_text(f"{CONF}command: {command}\n")
    proc = subprocess.Popen([sys.executable, "-m", "runner", "submit", "conf.yaml"], cwd=where, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    took = 0.0
    if interrupt is not None:
        def training() -> bool:
            logs = list(where.glob("runs/up-*/logs/attempt-1/rank-00000.log"))
            assert proc.poll() is None, "the run ended before it was interrupted"
            return bool(logs) and len(re.findall(r" (?:loss|Loss:) ", logs[0].read_text())) >= 6
        until("rank 0's sixth step", training, 120, every=0.05)
        proc.send_signal(interrupt)
        sent = time.monotonic()
    out, _ = proc.communicate(timeout=240)
    if interrupt is not None:
        took = time.monotonic() - sent
    [run] = where.glob("runs/up-*")
    return proc.returncode, out, RunDir(run), took


def exits(run: RunDir) -> list[dict[str, Any]]:
    return [e for e in run.events() if e["event"] == "exit"]


def steps(kind: str, run: RunDir, attempt: int = 1) -> dict[tuple[str, str], dict[int, tuple[str, str]]]:
    """Each step's (loss, weights) by rank, from both rank logs."""
    seen: dict[tuple[str, str], dict[int, tuple[str, str]]] = defaultdict(dict)
    for rank in (0, 1):
        for m in LINES[kind].finditer(run.rank_log(rank, attempt).read_text()):
            if kind == "torchrun":
                r, epoch, batch, loss, weights = m.groups()
            else:
                epoch, batch, r, loss, weights = m.groups()
            assert int(r) == rank, m.group(0)
            seen[(epoch, batch)][rank] = (loss, weights)
    return seen


@pytest.mark.parametrize("kind, command, says", [
    ("torchrun", TORCHRUN.format(epochs=2, sleep=0), "rank {r} of 2 (local {r}, group 0, run up-"),
    ("accelerate", ACCELERATE.format(epochs=2, sleep=0), "accelerate process {r} of 2 (DistributedType.MULTI_CPU)"),
], ids=["torchrun-script", "accelerate"])
def test_each_program_trains_one_world_of_two_ranks(tmp_path: Path, kind: str, command: str, says: str) -> None:
    code, out, run, _ = submit(tmp_path, command)
    assert code == 0, out
    assert [e["outcome"] for e in exits(run)] == ["completed"] and run.finished.exists()
    for rank in (0, 1):
        assert says.format(r=rank) in run.rank_log(rank).read_text()
    seen = steps(kind, run)
    both = [ranks for ranks in seen.values() if len(ranks) == 2]
    assert len(both) >= 16 and len(both) == len(seen), seen  # every step on both ranks
    for ranks in both:  # each rank its own shard (its own loss), one all-reduced gradient (the same weights)
        assert ranks[0][0] != ranks[1][0] and ranks[0][1] == ranks[1][1], ranks


@pytest.mark.parametrize("kind, command", [
    ("torchrun", TORCHRUN.format(epochs=50, sleep=0.05)),
    ("accelerate", ACCELERATE.format(epochs=50, sleep=0.05)),
], ids=["torchrun-script", "accelerate"])
def test_ctrl_c_stops_the_program_within_seconds_as_interrupted(tmp_path: Path, kind: str, command: str) -> None:
    code, out, run, took = submit(tmp_path, command, interrupt=signal.SIGINT)
    assert code == EXIT_REQUEUE and took < 10, (took, out)
    assert [(e["outcome"], e["exit_code"]) for e in exits(run)] == [("interrupted", EXIT_REQUEUE)], out
    assert not run.finished.exists() and "interrupted" in out
    for rank in (0, 1):
        assert "exit 75" in run.rank_log(rank).read_text()


def test_a_preemption_notice_reaches_the_scripts_own_handler_and_it_resumes_from_its_snapshot(tmp_path: Path) -> None:
    code, out, run, _ = submit(tmp_path, TORCHRUN.format(epochs=4, sleep=0.05), interrupt=signal.SIGUSR2)
    assert code == EXIT_REQUEUE, out
    assert [(e["outcome"], e["exit_code"]) for e in exits(run)] == [("preempted", EXIT_REQUEUE)]
    first = run.rank_log(0, 1).read_text()
    [epoch] = re.findall(r"^\[RANK0\] SIGTERM at epoch (\d+)$", first, re.M)  # the script's own handler ran
    assert f"Epoch {epoch} | Training snapshot saved at snapshot.pt" in first
    assert "SIGTERM at epoch" in run.rank_log(1, 1).read_text()
    out2 = subprocess.run([sys.executable, "-m", "runner", "resume", str(run.root)], capture_output=True, text=True,
                          env=ENV, timeout=240)
    assert out2.returncode == 0, out2.stdout + out2.stderr
    second = run.rank_log(0, 2).read_text()
    assert f"Resuming training from snapshot at Epoch {epoch}" in second and "[RANK0] done" in second
    assert [e["outcome"] for e in exits(run)] == ["preempted", "completed"] and run.finished.exists()
    resumed = {key for key in steps("torchrun", run, 2)}
    assert min(int(e) for e, _ in resumed) == int(epoch)


def test_a_single_process_script_on_two_ranks_stops_at_its_first_step_in_one_line(tmp_path: Path) -> None:
    code, out, run, _ = submit(tmp_path, "python torch_single.py")
    assert code == EXIT_PROGRAM, out
    [line] = [line for line in out.splitlines() if " ERROR " in line]
    assert "no process group" in line and "hint: " in line and "Traceback" not in out, out
    for rank in (0, 1):
        log = run.rank_log(rank).read_text()
        assert "no process group" in log and "Traceback" not in log and "Train Epoch" not in log, log
    [error] = [e for e in run.events() if e["event"] == "program_error"]
    assert error["reason"] == "world_size" and "2 separate copies" in error["detail"]
    assert exits(run)[-1]["exit_code"] == EXIT_PROGRAM and not run.finished.exists()
