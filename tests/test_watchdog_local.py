"""The hang watchdog's thread with real processes that really stop advancing, and real Lightning runs of runner's
whose phases it learns (the local tier; the analysis and the limit as tables: tests/test_watchdog.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runner.rundir import EXIT_HANG, RunDir, read_json
from tests import test_local_lifecycle as lifecycle
from tests.waiting import until

pytestmark = pytest.mark.local


# A rank without torch: steps every 20 ms under the real Watchdog, then stops advancing in the function named
# by its mode (a collective that waits forever, or a data loader's __getitem__), or keeps stepping (SIGSTOP target).
RANK = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    from runner.job.watchdog import Watchdog
    from runner.rundir import RunDir
    rd, rank, world, mode = RunDir(Path(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    floor = 600.0 if mode == "patient" else 1.0  # "patient": its own clock would not fire within the test
    wd = Watchdog(rd, rank, world, attempt=1, factor=10, floor_s=floor, interval_s=0.2, report_every_s=0.5).start()
    def barrier(): threading.Event().wait()
    def __getitem__(): time.sleep(3600)
    for step in range(10**6):
        wd.batch_start()
        time.sleep(0.06 if mode == "slow" else 0.01)  # forward
        wd.before_backward()
        time.sleep(0.01)
        wd.beat(step)
        if step == 30 and mode in ("collective", "data", "patient"):
            __getitem__() if mode == "data" else barrier()
        if step == 80 and mode in ("run", "slow"):
            break
""")


def _ranks(tmp_path: Path, modes: list[str]) -> tuple[RunDir, list[subprocess.Popen[bytes]]]:
    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, str(script), str(rd.root), str(r), str(len(modes)), m], env=env)
             for r, m in enumerate(modes)]
    return rd, procs


def test_a_stopped_rank_is_named_and_the_others_exit_with_the_hang_code(tmp_path: Path) -> None:
    rd, procs = _ranks(tmp_path, ["collective", "run", "collective"])
    try:
        # Every rank has beaten (its heartbeat file shows a step); then rank 1 is stopped mid-run, as with SIGSTOP
        # on a node.
        until("a heartbeat with a step from every rank",
              lambda: all(isinstance(b := read_json(rd.root / "heartbeats" / f"rank-{r:05d}.json"), dict)
                          and b.get("step", -1) >= 1 for r in range(3)), 30)
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        codes = [procs[0].wait(timeout=30), procs[2].wait(timeout=30)]
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    assert codes == [EXIT_HANG, EXIT_HANG]
    hang = json.loads((rd.root / "hang.json").read_text())
    assert hang["majority"] == "collective"
    assert [(s["rank"], s["state"]) for s in hang["suspects"]] == [(1, "not responding")]
    assert hang["nodes"] == [os.uname().nodename]
    assert json.loads(rd.last_exit.read_text())["code"] == EXIT_HANG
    assert [e["event"] for e in rd.events()] == ["hang"]
    assert elapsed < 10


def _finish(tmp_path: Path, modes: list[str], timeout: float) -> tuple[RunDir, list[int]]:
    rd, procs = _ranks(tmp_path, modes)
    try:
        return rd, [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()


def test_a_rank_stuck_in_its_data_loader_is_named_against_the_waiting_ones(tmp_path: Path) -> None:
    rd, codes = _finish(tmp_path, ["collective", "data", "collective"], 30)
    assert codes == [EXIT_HANG] * 3
    hang = json.loads((rd.root / "hang.json").read_text())
    assert [(s["rank"], s["state"]) for s in hang["suspects"]] == [(1, "in data")]
    assert "__getitem__" in hang["suspects"][0]["where"]
    assert "rank 1 on" in hang["summary"] and "2 of 3 ranks in collective" in hang["summary"]


def test_a_rank_slow_to_notice_answers_the_first_report_instead_of_being_named(tmp_path: Path) -> None:
    """Rank 2's own limit is 600 s: it reports when rank 0's report asks it to, so only the odd rank is named
    (a loaded node's rank noticing late was named "not responding" beside the stuck one)."""
    rd, codes = _finish(tmp_path, ["collective", "data", "patient"], 30)
    assert codes == [EXIT_HANG] * 3
    hang = json.loads((rd.root / "hang.json").read_text())
    assert [(s["rank"], s["state"]) for s in hang["suspects"]] == [(1, "in data")]
    assert hang["phases"] == {"collective": 2, "data": 1}


def test_a_slow_rank_is_reported_once_by_rank_0(tmp_path: Path) -> None:
    rd, codes = _finish(tmp_path, ["run", "run", "slow"], 60)
    assert codes == [0, 0, 0]
    events = [e for e in rd.events() if e["event"] == "straggler"]
    assert [(e["rank"], e["slow"]) for e in events] == [(2, "forward")]
    assert events[0]["compute_x"] > 3
    latest = json.loads((rd.root / "stragglers.json").read_text())["ranks"]
    assert latest[0]["rank"] == 2


def test_a_stopped_rank_of_a_run_of_0_1_s_steps_is_named_within_15_s(tmp_path: Path) -> None:
    """Two ranks of runner's own Trainer (gloo DDP, a real all-reduce per step), 0.1 s steps, the default watchdog:
    rank 1 SIGSTOPped; rank 0 waits in its next step's collective, where no phase is marked, and its step limit
    (the 5 s floor: 10x its 0.1 s steps is less) names rank 1 not responding, with hang.json, within 15 s of the last
    step. Stopped after the first checkpoints: a checkpoint's own allowance is learned by then."""
    proc, run = lifecycle.submit(tmp_path, "model.step_time_s=0.1", "trainer.max_steps=100000",
                                 "data.num_samples=100000")  # no epoch's end (its first occurrence) before the stop
    rd = RunDir(run)
    lifecycle.wait_for(run / "checkpoints" / "step-0000020" / "COMPLETE", proc)
    pid = lifecycle.owner(run, 1)["ranks"][1]
    try:
        os.kill(pid, signal.SIGSTOP)
        stopped = time.time()
        until("hang.json", rd.hang.exists, 60)
        out, _ = proc.communicate(timeout=120)
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_HANG, out
    hang = json.loads(rd.hang.read_text())
    assert [(s["rank"], s["state"]) for s in hang["suspects"]] == [(1, "not responding")], hang
    report = rd.hang_report(1, 0)
    waited = json.loads(report.read_text())
    last_step = report.stat().st_mtime - waited["stalled_s"]  # rank 0's: the report is written when it fires
    assert (waited["during"], waited["limit_s"]) == (None, 5.0), waited
    print(f"SIGSTOP -> hang.json {hang['time'] - stopped:.1f} s; rank 0's last step -> hang.json "
          f"{hang['time'] - last_step:.1f} s (it fired {waited['stalled_s']} s after it)")
    assert hang["time"] - last_step < 15 and hang["time"] - stopped < 15


SLOW_PHASES = """
import os
import time

from runner.dev.example import TinyRegressor


class SlowPhases(TinyRegressor):
    \"\"\"A validation of 20 s (its one batch) and checkpoints of 10 s (the module's own on_save_checkpoint).\"\"\"

    def validation_step(self, batch, batch_idx):
        self.said("validation")
        time.sleep(20)
        return super().validation_step(batch, batch_idx)

    def on_save_checkpoint(self, checkpoint):
        self.said("checkpoint")
        time.sleep(10)

    def said(self, what):
        with open(os.environ["SLOW_PHASES_LOG"], "a") as f:
            f.write(what + "\\n")
"""


def test_a_20_s_validation_and_a_10_s_checkpoint_are_no_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default watchdog (a 5 s floor, 0.1 s steps): two epochs of 20 steps (40 batches: 2 accumulated per step),
    each ending in a validation of 20 s, and runner's checkpoints every 15 steps (at 15 and 30), each taking 10 s
    (the second of each measured by the first), train to the end: no hang.json, exit 0. With the phase markers taken
    out of runner's callback, the first validation is named a hang 5 s into it (tried by hand)."""
    (tmp_path / "slowphases.py").write_text(SLOW_PHASES)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("SLOW_PHASES_LOG", str(tmp_path / "phases.log"))
    proc, run = lifecycle.submit(tmp_path / "runs", "model._target_=slowphases.SlowPhases", "model.step_time_s=0.1",
                                 "trainer.max_steps=40", "data.num_samples=1280", "trainer.limit_val_batches=1",
                                 "checkpoint.every_n_steps=15")
    out, _ = proc.communicate(timeout=400)
    rd = RunDir(run)
    assert proc.returncode == 0, out
    assert not rd.hang.exists() and rd.finished.exists()
    logs = rd.rank_log(0).read_text()
    assert "no progress for" not in logs and logs.count("checkpoint step-") >= 2, logs
    seen = (tmp_path / "phases.log").read_text().split()  # what the program's own hooks did, on each rank
    assert (seen.count("validation"), seen.count("checkpoint")) == (4, 4), seen  # 2 of each, on 2 ranks
