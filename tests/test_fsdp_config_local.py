"""``fsdp.blocks`` at `runner validate`, as a process: exit 2, one line, no traceback (the local tier; the rules:
tests/test_fsdp_config.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_config import QUICKSTART, write
from tests.test_fsdp_config import FSDP

pytestmark = pytest.mark.local


def test_validate_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, QUICKSTART)
    out = subprocess.run([sys.executable, "-m", "runner", "validate", str(path), *FSDP, "fsdp.blocks=[Block, 3]"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("runner: error: ") and "fsdp.blocks[1]: found 3; expected a module class name" in line
