"""The one flock every login-side lock goes through (cron, `runner parallel`, alert queues, straggler notices,
the dev cluster): who holds it, and what happens where no lock can be had."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.rundir import locked

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("fail_open", [False, True])
def test_where_no_lock_can_be_had_it_raises_unless_told_to_go_on_unlocked(tmp_path: Path, fail_open: bool) -> None:
    (tmp_path / "file").write_text("")
    lock = tmp_path / "file" / ".lock"  # its folder is a file: cannot be created
    if not fail_open:
        with pytest.raises(OSError), locked(lock, blocking=False):
            pass
        return
    with locked(lock, blocking=False, fail_open=True) as held:
        assert held is True


def test_an_error_in_the_block_propagates_and_releases_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / ".lock"
    with pytest.raises(ValueError), locked(lock):
        raise ValueError("in the block")
    with locked(lock, blocking=False) as held:
        assert held is True
