"""Fabric programs as Fabric's users write them (tests/programs/), under `runner submit` with 2 local processes and
``runtime: none``: one written for ``fabric run`` (Lightning's image classifier example: ``Fabric()``, no
``launch()``) run with ``command: fabric run ...``, which runner launches itself; one that calls ``fabric.launch()``
run with ``python``. Each trains runner's world (ranks 0 and 1 of 2; each rank's own shard and loss, the same weights
after every step) and Ctrl-C stops it within seconds as ``interrupted``; a ``fabric run`` whose devices are not
runner's is refused before any rank starts."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from runner.rundir import EXIT_REQUEUE, RunDir
from tests.test_user_programs_local import ENV, exits, submit

pytestmark = pytest.mark.local
CLASSIFIER = "fabric run --devices ${{num_device}} fabric_image_classifier.py --epochs {epochs} --sleep {sleep}"
LAUNCH = ("python fabric_launch.py --devices ${{num_device}} --num-nodes ${{num_nodes}} --epochs {epochs} "
          "--sleep {sleep}")
LINE = re.compile(r"^Train Epoch: (\d+) \[(\d+)\] rank (\d) Loss: (\S+) weights (\S+)$", re.M)


def steps(run: RunDir, attempt: int = 1) -> dict[tuple[str, str], dict[int, tuple[str, str]]]:
    """Each step's (loss, weights) by rank, from both rank logs."""
    seen: dict[tuple[str, str], dict[int, tuple[str, str]]] = defaultdict(dict)
    for rank in (0, 1):
        for m in LINE.finditer(run.rank_log(rank, attempt).read_text()):
            epoch, batch, r, loss, weights = m.groups()
            assert int(r) == rank, m.group(0)
            seen[(epoch, batch)][rank] = (loss, weights)
    return seen


@pytest.mark.parametrize("command", [CLASSIFIER.format(epochs=2, sleep=0), LAUNCH.format(epochs=2, sleep=0)],
                         ids=["fabric-run", "fabric-launch"])
def test_each_fabric_program_trains_runners_world_of_two_ranks(tmp_path: Path, command: str) -> None:
    code, out, run, _ = submit(tmp_path, command)
    assert code == 0, out
    assert [e["outcome"] for e in exits(run)] == ["completed"] and run.finished.exists()
    for rank in (0, 1):
        log = run.rank_log(rank).read_text()
        assert f"fabric rank {rank} of 2" in log and "Traceback" not in log, log
    seen = steps(run)
    assert len(seen) >= 16 and all(len(ranks) == 2 for ranks in seen.values()), seen  # every step on both ranks
    for ranks in seen.values():  # each rank its own shard (its own loss), one all-reduced gradient (the same weights)
        assert ranks[0][0] != ranks[1][0] and ranks[0][1] == ranks[1][1], ranks


@pytest.mark.parametrize("command", [CLASSIFIER.format(epochs=50, sleep=0.05), LAUNCH.format(epochs=50, sleep=0.05)],
                         ids=["fabric-run", "fabric-launch"])
def test_ctrl_c_stops_a_fabric_program_within_seconds_as_interrupted(tmp_path: Path, command: str) -> None:
    code, out, run, took = submit(tmp_path, command, interrupt=signal.SIGINT)
    assert code == EXIT_REQUEUE and took < 10, (took, out)
    assert [(e["outcome"], e["exit_code"]) for e in exits(run)] == [("interrupted", EXIT_REQUEUE)], out
    assert not run.finished.exists() and "interrupted" in out


def test_a_fabric_run_of_another_world_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "train.py").touch()
    (tmp_path / "conf.yaml").write_text("num_nodes: 1\nnum_device: 2\nrunner:\n  scheduler: local\n"
                                        "command: fabric run --devices 4 train.py --epochs 3\n")
    for verb in ("validate", "submit"):
        out = subprocess.run([sys.executable, "-m", "runner", verb, "conf.yaml"], cwd=tmp_path, env=ENV, text=True,
                             capture_output=True, timeout=60)
        assert out.returncode == 2 and out.stdout == "" and not (tmp_path / "runs").exists(), out
        assert out.stderr.splitlines() == ["runner: error: conf.yaml:5: command: found --devices 4; expected 2 (= "
                                           "num_device: runner starts the ranks). hint: write --devices "
                                           "${num_device}, or leave it out"], out.stderr
