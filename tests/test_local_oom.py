"""A local rank the kernel's OOM killer ends is named as an OOM, with its rank, not as a bare SIGKILL: a real OOM kill
in a memory cgroup (root; cgroup v1 or v2); the reading of /proc/vmstat as a table is in
tests/test_local_oom_unit.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.host.local import oom_kills
from tests.ci import need

pytestmark = pytest.mark.local

CONF = """\
num_nodes: 1
num_device: 2
command: python grow.py
runner:
  name: oom
  scheduler: local
  container: {runtime: none}
"""
# Rank 1 fills 3 GiB (b"\\1" * n writes every page; bytearray(n) would not), beyond its cgroup's 1.5 GiB; rank 0 waits.
GROW = """\
import os, time
if os.environ["RANK"] == "1":
    grown = b"\\1" * (3 << 30)
time.sleep(120)
"""
LIMIT = 1536 << 20


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A memory cgroup limited to LIMIT without swap; yields its ``cgroup.procs``."""
    need(os.geteuid() == 0, "a memory cgroup needs root")
    name = f"runner-test-oom-{uuid.uuid4().hex[:8]}"
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists() and "memory" in v2.read_text().split():
        Path("/sys/fs/cgroup/cgroup.subtree_control").write_text("+memory")
        group = Path("/sys/fs/cgroup") / name
        group.mkdir()
        (group / "memory.max").write_text(str(LIMIT))
        (group / "memory.swap.max").write_text("0")
    else:
        base = Path("/sys/fs/cgroup/memory")
        need(base.is_dir(), "no memory cgroup controller (v1 or v2) on this machine")
        group = base / name
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(LIMIT))
        if (group / "memory.memsw.limit_in_bytes").exists():
            (group / "memory.memsw.limit_in_bytes").write_text(str(LIMIT))
    try:
        yield group / "cgroup.procs"
    finally:
        group.rmdir()


@pytest.mark.local
def test_a_rank_the_oom_killer_ends_is_named_as_an_oom(tmp_path: Path, memory_cgroup: Path) -> None:
    (tmp_path / "conf.yaml").write_text(CONF)
    (tmp_path / "grow.py").write_text(GROW)
    before = oom_kills()
    assert before is not None
    out = subprocess.run([sys.executable, "-m", "runner", "submit", "conf.yaml"], cwd=tmp_path, text=True,
                         capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         preexec_fn=lambda: memory_cgroup.write_text("0"))  # this process, then its ranks
    assert out.returncode == 137, out.stdout + out.stderr
    [run] = (tmp_path / "runs").glob("oom-*")
    [end] = [e for e in map(json.loads, (run / "ledger.jsonl").read_text().splitlines()) if e["event"] == "exit"]
    assert end["outcome"] == "failed" and end["cause"].startswith("rank 1 on "), end
    assert end["cause"].endswith(": OOM (killed by SIGKILL as the kernel's OOM killer ran)"), end
    assert "OOM" in out.stdout + out.stderr
    assert (oom_kills() or 0) > before
