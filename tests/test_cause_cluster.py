"""The first rank to fail is the cause, on Slurm too (issue 31): on the dev cluster (2 nodes x 2 ranks), rank 3 on n2
is SIGKILLed; the alert (a real HTTP server), `runner status` and `last_cause` name rank 3 on n2, killed, never rank
0's gloo "Connection closed by peer" that followed it.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from runner.dev import devcluster
from tests.test_failures import checkpoint_done, env_for, hook, status, submit, wait_for

pytestmark = pytest.mark.slurm
__all__ = ["hook"]  # the fixture, shared with tests/test_failures.py


def test_the_killed_rank_is_the_cause_not_its_peers_echo(slurm_cluster: devcluster.Cluster, hook: Any,
                                                         tmp_path: Path) -> None:
    env = env_for(slurm_cluster, hook)
    run = submit(env, tmp_path)
    wait_for("checkpoint 10", lambda: checkpoint_done(run, 10), 120, run)
    rank3 = json.loads((run / "ranks" / "rank-00003.json").read_text())
    assert rank3["hostname"] == "n2", rank3
    os.kill(rank3["pid"], signal.SIGKILL)
    wait_for("the exit hook's record", lambda: status(env, run)["last_cause"] is not None, 90, run)
    row = status(env, run)
    assert row["state"] == "failed" and row["last_outcome"] == "failed", row
    assert row["last_cause"].startswith("rank 3 on n2: killed"), row["last_cause"]
    [alert] = hook.wait_for(1, timeout=60)
    assert alert["event"] == "failed" and alert["cause"] == row["last_cause"], alert
    assert "Connection closed" not in alert["cause"]
    assert alert["extra"]["log"].endswith("rank-00003.log"), alert["extra"]
