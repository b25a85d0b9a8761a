"""Preflight in real local runs (the local tier; formulas, parsers and checks: tests/test_preflight.py; the cluster:
tests/test_preflight_cluster.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.checks import FAIL, PASS
from runner.job import ifname, netenv
from tests.test_preflight import QUICKSTART, cfg

pytestmark = pytest.mark.local


def test_apply_and_record(tmp_path: Path) -> None:
    ne = netenv.plan(cfg(), tmp_path / "logs", {"MASTER_ADDR": "127.0.0.1"}, ifname.detect_ifname("127.0.0.1"))
    assert ne.ifname == "lo"
    env: dict[str, str] = {}
    netenv.apply(ne, env)
    assert env["GLOO_SOCKET_IFNAME"] == "lo" and (tmp_path / "logs" / "nccl").is_dir()
    netenv.record(ne, tmp_path / "env.json")
    data = json.loads((tmp_path / "env.json").read_text())
    assert data["vars"]["NCCL_DEBUG"] == {"value": "WARN", "source": "runner", "runner_value": None}
    assert data["overridden"] == [] and data["pg_timeout_s"] == 60


def runner_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, env=full,
                          timeout=timeout)


def test_runner_preflight_locally_passes_and_prints_the_table(tmp_path: Path) -> None:
    t = time.monotonic()
    out = runner_cli("preflight", str(QUICKSTART), f"run_root={tmp_path}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert time.monotonic() - t < 30
    assert "preflight PASS" in out.stdout and "busbw" in out.stdout and "interface" in out.stdout
    run = next(tmp_path.glob("quickstart-preflight-*"))
    report = json.loads((run / "preflight.json").read_text())
    assert report["status"] == PASS and report["backend"] == "gloo" and report["duration_s"] < 15
    assert report["bandwidth"]["job"]["ranks"] == 2 and report["bandwidth"]["job"]["busbw_gbps"] > 0
    assert not (run / "finished").exists() and not any((run / "checkpoints").iterdir())  # never trained
    env = json.loads((run / "env.json").read_text())
    assert env["vars"]["GLOO_SOCKET_IFNAME"]["value"] == "lo"


def test_training_stops_before_the_first_step_on_a_wrong_interface(tmp_path: Path, webhook) -> None:  # type: ignore[no-untyped-def]
    t = time.monotonic()
    out = runner_cli("submit", str(QUICKSTART), f"run_root={tmp_path}", "network.ifname=eth9", "alerts.kind=json",
                     "preflight.paths=[/nonexistent/dataset]", env={"RUNNER_WEBHOOK_URL": webhook.url})
    elapsed = time.monotonic() - t
    assert out.returncode == 77, out.stdout + out.stderr
    assert elapsed < 30
    run = next(tmp_path.glob("quickstart-*"))
    report = json.loads((run / "preflight.json").read_text())
    failed = {(c["name"], c["value"]) for c in report["checks"] if c["status"] == FAIL}
    assert ("interface", "eth9 not found") in failed
    assert ("path", "/nonexistent/dataset missing") in failed
    iface = next(c for c in report["checks"] if c["name"] == "interface")
    assert "lo (127.0.0.1)" in iface["hint"]
    assert report["duration_s"] < 15 and report["backend"] is None  # no process group with a bad interface
    assert "eth9 not found" in (run / "preflight.txt").read_text()
    assert not any((run / "checkpoints").iterdir()) and not (run / "finished").exists()
    assert [e["status"] for e in map(json.loads, (run / "ledger.jsonl").read_text().splitlines())
            if e["event"] == "preflight"] == ["fail"]
    alert = webhook.wait_for(1)[0]
    assert alert["event"] == "preflight_failed" and alert["exit_code"] == 77
    assert "eth9 not found" in alert["cause"] and webhook.secret not in json.dumps(alert)
