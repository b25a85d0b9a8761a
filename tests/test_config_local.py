"""Config validation through the CLI, as a process (the local tier; the rules themselves: tests/test_config.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_config import QUICKSTART, write

pytestmark = pytest.mark.local


def test_cli_prints_one_line_per_problem_without_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, QUICKSTART)
    out = subprocess.run([sys.executable, "-m", "runner", "validate", str(path), "trainer.devices=3",
                          "dataloader.valid.total_shards=3"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 2 and all(e.startswith("runner: error: ") for e in errors)
