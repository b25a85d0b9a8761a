"""tests/leftovers.py: a process a test started and left running is killed once the test is done, and named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import alive

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.local

INNER = '''
import subprocess, sys
from pathlib import Path

def test_leaves_a_process(tmp_path):
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)  # out of reach of the test's process group
    Path("{pidfile}").write_text(str(proc.pid))
'''


def test_a_process_left_running_by_a_test_is_killed_and_named(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    (tmp_path / "test_inner.py").write_text(INNER.format(pidfile=pidfile))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.leftovers", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_inner.py")],
                         capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stdout + out.stderr
    pid = int(pidfile.read_text())
    assert not alive(pid)
    assert "processes left by tests" in out.stdout, out.stdout
    assert "test_leaves_a_process: 1 killed, first sleep 300" in out.stdout, out.stdout
