"""``runner.progress``, locally: a plain PyTorch program (tests/programs/torch_progress.py, PyTorch's MNIST example
made DDP, with the one line) under `runner submit` on 2 real processes with runtime none gets the hang watchdog, the
non-finite guard and the report's steps, as a Lightning Trainer gets them from runner's callback."""

from __future__ import annotations

import html
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runner.rundir import EXIT_HANG, EXIT_NONFINITE, RunDir, read_json
from tests.waiting import until

pytestmark = pytest.mark.local
PROGRAM = Path(__file__).resolve().parent / "programs" / "torch_progress.py"
CONF = """\
num_nodes: 1
num_device: 2
runner:
  name: pp
  scheduler: local
  container: {runtime: none}
"""


def start(where: Path, *overrides: str, command: str = "python mnist_ddp.py",
          **env: str) -> tuple[subprocess.Popen[str], Path]:
    """`runner submit` of ``command`` in ``where``, its environment plus ``env`` (the program's test knobs)."""
    shutil.copy(PROGRAM, where / "mnist_ddp.py")
    (where / "conf.yaml").write_text(f"{CONF}command: {command}\n")
    proc = subprocess.Popen([sys.executable, "-m", "runner", "submit", "conf.yaml", *overrides], cwd=where,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **env}, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    return proc, where


def ended(proc: subprocess.Popen[str], where: Path) -> tuple[int, str, RunDir]:
    out, _ = proc.communicate(timeout=240)
    [run] = where.glob("runs/pp-*")
    return proc.returncode, out, RunDir(run)


def events(run: RunDir, name: str) -> list[dict[str, Any]]:
    return [e for e in run.events() if e["event"] == name]


def test_a_plain_program_with_the_one_line_finishes_and_its_report_draws_its_steps(tmp_path: Path) -> None:
    code, out, run = ended(*start(tmp_path, STEP_SLEEP="0.1"))  # 3 s: heartbeats too
    assert code == 0, out
    assert "trained 30 steps" in run.rank_log(0).read_text()
    [begun] = events(run, "train_start")
    assert (begun["step"], begun["lost_steps"], begun["resumed_from"]) == (1, 0, None)
    assert read_json(run.progress)["step"] == 30  # its last step, written when it ended
    beat = read_json(run.heartbeats / "rank-00001.json")
    assert beat["step"] >= 1 and beat["step_s"] is not None
    report = subprocess.run([sys.executable, "-m", "runner", "report", str(run.root)], capture_output=True, text=True,
                            timeout=60)
    assert report.returncode == 0, report.stderr
    page = html.unescape(run.report_page.read_text())
    assert "attempt 1: steps 1 to 30" in page  # the steps chart's line
    assert "runner kept no checkpoint" in page and "no steps were kept" not in page
    assert "runner sees no steps" not in page


def test_a_program_that_shows_runner_no_step_is_reported_as_such(tmp_path: Path) -> None:
    """A command runner sees no step of (not Python: no hook, no runner.progress): the report says so once, labels
    its time "the program ran" instead of startup, draws no empty steps chart, and says runner kept no checkpoint
    rather than that no steps were kept."""
    code, out, run = ended(*start(tmp_path, command="sleep 2"))
    assert code == 0, out
    rows = subprocess.run([sys.executable, "-m", "runner", "status", str(run.root), "--json"], capture_output=True,
                          text=True, timeout=60)
    [row] = json.loads(rows.stdout)
    assert row["losses_s"]["the program ran"] >= 2.0 and row["losses_s"]["startup"] > 0, row
    report = subprocess.run([sys.executable, "-m", "runner", "report", str(run.root)], capture_output=True, text=True,
                            timeout=60)
    assert report.returncode == 0, report.stderr
    page = html.unescape(run.report_page.read_text())
    assert page.count("runner sees no steps of this program") == 1
    assert "the program ran (runner sees no steps of it)" in page and "the program ran 2." in page
    assert "No steps to draw" in page and '<svg class="steps"' not in page
    assert "runner kept no checkpoint of this program" in page and "no steps were kept" not in page


def test_a_stopped_rank_of_a_plain_program_is_named_as_a_hang(tmp_path: Path) -> None:
    proc, where = start(tmp_path, "runner.watchdog.plain_floor_s=4", EPOCHS="100", STEP_SLEEP="0.02")

    def training() -> Any:
        assert proc.poll() is None, "the run ended"
        runs = list(where.glob("runs/pp-*"))
        beat = read_json(runs[0] / "heartbeats" / "rank-00001.json") if runs else None
        return runs and isinstance(beat, dict) and beat.get("step", 0) >= 5 and runs[0]

    run = RunDir(until("rank 1 at step 5", training, 120))
    pid = read_json(run.rank_record(1))["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        code, out, run = ended(proc, where)
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGCONT)
    assert code == EXIT_HANG, out
    hang = read_json(run.hang)
    assert [(s["rank"], s["state"]) for s in hang["suspects"]] == [(1, "not responding")], hang
    assert "rank 1 on" in hang["summary"] and [e["summary"] for e in events(run, "hang")] == [hang["summary"]]
    assert events(run, "exit")[-1]["outcome"] == "hang"


@pytest.mark.parametrize("nan_rank", [None, "1"], ids=["every-rank", "one-rank"])
def test_a_nan_in_a_plain_program_stops_every_rank_as_runners_guard_does(tmp_path: Path, nan_rank: str | None) -> None:
    """The loss turns NaN at step 12 (on every rank, or on rank 1 alone: then rank 0, waiting for rank 1 in its
    next step's all-reduce, is stopped by its watchdog thread): one ``nonfinite`` event, every rank exits 80, and
    the attempt ends as a NaN with its step, as a Trainer's non-finite guard ends it."""
    knobs = {"NAN_AT_STEP": "12", **({"NAN_RANK": nan_rank} if nan_rank else {})}
    code, out, run = ended(*start(tmp_path, **knobs))
    assert code == EXIT_NONFINITE, out
    [nan] = events(run, "nonfinite")
    assert (nan["step"], nan["what"]) == (12, "loss nan")
    [end] = events(run, "exit")
    assert end["outcome"] == "nan" and end["codes"] == [EXIT_NONFINITE, EXIT_NONFINITE], end
    assert "step 12" in end["cause"] and not run.finished.exists()
    assert "trained" not in run.rank_log(0).read_text()  # the program's code after its loop never ran
