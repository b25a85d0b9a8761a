"""An OOM kill read as such, the unit tier: /proc/vmstat as a table and the cause kind (the real OOM kill:
tests/test_local_oom.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from runner.alerts.causes import RankExit, first_failure, srun_exits
from runner.host.local import oom_kills

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("text", "expected"), [
    ("nr_free_pages 100\noom_kill 3\nnr_zspages 0\n", 3),
    ("nr_free_pages 100\n", None),  # a kernel before 4.13
    ("oom_kill x\n", None),
])
def test_oom_kills_are_read_from_vmstat(tmp_path: Path, text: str, expected: int | None) -> None:
    (tmp_path / "vmstat").write_text(text)
    assert oom_kills(tmp_path / "vmstat") == expected
    assert oom_kills(tmp_path / "missing") is None


def test_an_oom_is_the_cause_kind_locally_and_on_slurm() -> None:
    local = first_failure([RankExit(1, -signal.SIGKILL, 1.0, "vm", oom=True), RankExit(0, 1, 2.0, "vm")], {})
    assert local is not None and local.why.kind == "oom" and local.exit_code == 137
    assert local.cause == "rank 1 on vm: OOM (killed by SIGKILL as the kernel's OOM killer ran)"
    slurm = first_failure(srun_exits(["srun: error: n2: task 3: Out Of Memory"]), {})
    assert slurm is not None and slurm.why.kind == "oom" and slurm.cause == "rank 3 on n2: OOM (srun: Out Of Memory)"
    plain = first_failure([RankExit(1, -signal.SIGKILL, 1.0, "vm")], {})
    assert plain is not None and plain.why.kind == "rank" and plain.cause == "rank 1 on vm: killed by SIGKILL"
