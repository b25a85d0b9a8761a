"""The one flock, held by a second process (the local tier; the rest: tests/test_rundir.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runner.rundir import locked

pytestmark = pytest.mark.local


HOLD = "import sys,time; from pathlib import Path; from runner.rundir import locked\n" \
       "with locked(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(30)"


def test_a_second_process_is_refused_while_the_first_holds_it_and_gets_it_once_the_holder_dies(
        tmp_path: Path) -> None:
    lock = tmp_path / "sub" / ".lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with locked(lock, blocking=False) as held:
            assert held is False
    finally:
        holder.kill()
        holder.wait()
    with locked(lock, blocking=False) as held:  # the kernel dropped the killed holder's lock
        assert held is True
        with locked(lock, blocking=False) as again:  # another open file of this process is another holder
            assert again is False
    with locked(lock, blocking=False) as held:  # released at the end of the block
        assert held is True
