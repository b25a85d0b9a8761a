"""The tiers' guard seen from outside: a pytest session of its own whose unit test starts a process (the local tier; the
rules: tests/test_tiers.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.local


def test_a_unit_test_that_starts_a_process_fails(tmp_path: Path) -> None:
    """The guard of tests/conftest.py, seen from outside: a pytest session whose unit test runs `true`."""
    (tmp_path / "test_starts.py").write_text(
        "import subprocess\nimport pytest\npytestmark = pytest.mark.unit\n\n"
        "def test_runs_true():\n    subprocess.run(['true'], check=True)\n\n"
        "def test_runs_nothing():\n    pass\n")
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n"
                                          "from tests.conftest import _unit_starts_no_process  # noqa: F401\n")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "COLUMNS": "300"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 passed, 1 error" in proc.stdout, proc.stdout  # test_runs_true passes, then errors at teardown
    said = "ERROR test_starts.py::test_runs_true - Failed: a unit test started 1 process(es), first fork_exec(['true'])"
    assert said in proc.stdout, proc.stdout
