"""The hang watchdog's thread with real processes that really stop advancing (the local tier; the analysis as tables:
tests/test_watchdog.py)."""

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
