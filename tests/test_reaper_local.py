"""The step reaper (``python -m runner.host.jobhook reap``, resume.in_job with spares) as the batch script runs it,
against a real process standing for srun: it ends the step once the ranks of a node went silent after their peers
failed, never while one of them still beats, and records ``nodes_lost`` first. The rank files are written here as
the launcher and the watchdog write them; the whole path on the dev cluster is tests/test_injob_cluster.py's lost
node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runner.host import jobhook
from runner.rundir import ATTEMPT_ENV, RunDir, atomic_write

pytestmark = pytest.mark.local

HOSTS = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}


def _rank_files(run: RunDir, attempt: int) -> None:
    run.ranks.mkdir(parents=True)
    run.heartbeats.mkdir()
    for rank, host in HOSTS.items():
        atomic_write(run.rank_record(rank), json.dumps({"rank": rank, "hostname": host, "attempt": attempt}))


def _beat(run: RunDir, rank: int, attempt: int) -> float:
    now = time.time()
    atomic_write(run.heartbeat(rank), json.dumps({"rank": rank, "host": HOSTS[rank], "attempt": attempt,
                                                  "time": now}))
    return now


def test_a_node_silent_after_its_peers_failed_ends_the_step_only_once_silent(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    _rank_files(run, 2)
    for rank in HOSTS:
        _beat(run, rank, 2)
    step = subprocess.Popen(["sleep", "600"])  # srun, waiting for the lost node's tasks
    env = {**os.environ, ATTEMPT_ENV: "2", "SLURM_JOB_ID": "7"}
    reaper = subprocess.Popen([sys.executable, "-m", "runner.host.jobhook", "reap", "--pid", str(step.pid),
                               "--world", "4", str(run.root)], env=env)
    stop = threading.Event()
    try:
        # n1's ranks fail on their lost peers; n2's ranks beat for a while yet (a node slow to die, or not dead)
        run.write_rank_exit(0, 2, 1)
        run.write_rank_exit(1, 2, 1)
        last = 0.0

        def beating() -> None:
            nonlocal last
            for _ in range(6):
                last = max(_beat(run, 2, 2), _beat(run, 3, 2))
                if stop.wait(0.5):
                    return

        beater = threading.Thread(target=beating)
        beater.start()
        beater.join()
        assert step.wait(timeout=30) == -9  # the reaper ended the step: SIGKILL
        assert reaper.wait(timeout=10) == 0
    finally:
        stop.set()
        step.kill()
        reaper.kill()
    [lost] = [e for e in run.events() if e["event"] == "nodes_lost"]
    assert lost["nodes"] == ["n2"] and lost["attempt"] == 2 and lost["job_id"] == "7"
    assert lost["time"] - last >= jobhook.SILENT_S  # never while n2 still beat
    assert lost["silent_s"] >= jobhook.SILENT_S


def test_the_silence_a_lost_node_kept_before_its_peers_failed_counts(tmp_path: Path) -> None:
    """A node lost a while before its peers fail on it (they were computing): its ranks' heartbeats are already old
    when the reaper first reads them, and that age counts. Counted from the reaper's first look, the step would
    wait the whole SILENT_S more."""
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    _rank_files(run, 2)
    old = time.time() - (jobhook.SILENT_S - 1)
    for rank in HOSTS:
        _beat(run, rank, 2)
        if HOSTS[rank] == "n2":  # n2's last beats, SILENT_S - 1 s ago by the file system's clock
            os.utime(run.heartbeat(rank), (old, old))
    step = subprocess.Popen(["sleep", "600"])
    env = {**os.environ, ATTEMPT_ENV: "2", "SLURM_JOB_ID": "7"}
    reaper = subprocess.Popen([sys.executable, "-m", "runner.host.jobhook", "reap", "--pid", str(step.pid),
                               "--world", "4", str(run.root)], env=env)
    try:
        failed = time.time()
        run.write_rank_exit(0, 2, 1)
        run.write_rank_exit(1, 2, 1)
        assert step.wait(timeout=30) == -9 and reaper.wait(timeout=10) == 0
    finally:
        step.kill()
        reaper.kill()
    [lost] = [e for e in run.events() if e["event"] == "nodes_lost"]
    assert lost["nodes"] == ["n2"] and lost["silent_s"] >= jobhook.SILENT_S
    assert lost["time"] - failed < jobhook.SILENT_S - 2, lost  # not SILENT_S after the peers' failure


def test_the_reaper_ends_with_a_step_that_ended_as_steps_do(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    _rank_files(run, 1)
    step = subprocess.Popen(["sleep", "600"])
    reaper = subprocess.Popen([sys.executable, "-m", "runner.host.jobhook", "reap", "--pid", str(step.pid),
                               "--world", "4", str(run.root)], env={**os.environ, ATTEMPT_ENV: "1"})
    try:
        for rank in HOSTS:  # every rank failed and said so: srun's to end, nothing for the reaper
            run.write_rank_exit(rank, 1, 1)
        step.terminate()
        step.wait(timeout=10)
        assert reaper.wait(timeout=10) == 0
    finally:
        step.kill()
        reaper.kill()
    assert not [e for e in run.events() if e["event"] == "nodes_lost"]
