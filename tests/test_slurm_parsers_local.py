"""Slurm's commands as runner runs them on this machine (the local tier; the parsers against recorded output:
tests/test_slurm_parsers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.host import slurm
from runner.job import ifname
from tests.test_slurm_parsers import fake_slurm

pytestmark = pytest.mark.local


def test_the_dry_run_prints_the_argv_that_is_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`runner submit --dry-run` shows the plan's argv; the submission runs that very argv (one function builds
    both, bad nodes left out alike)."""
    from runner.host import nodes, submit

    assert slurm.sbatch_argv("/r/job.sbatch", ["--exclude=n1"], after="7") == [
        "sbatch", "--parsable", "--exclude=n1", "--dependency=afternotok:7", "--kill-on-invalid-dep=yes",
        "/r/job.sbatch"]
    nodes.record(tmp_path, ["n2", "n1"], "hang", "earlier")
    p = submit.plan(Path(__file__).parents[1] / "conf" / "slurm-2node.yaml", [f"run_root={tmp_path}"])
    assert p.argv == ["sbatch", "--parsable", "--exclude=n1,n2", str(p.run.script)]
    assert f"command:       {' '.join(p.argv)}" in str(p)
    # The partition (sinfo) holds the job without the bad nodes: the plan's own argv goes out.
    calls = fake_slurm(monkeypatch, {"sbatch": "41\n", "sinfo": "n1 debug*\nn2 debug*\nn3 debug*\nn4 debug*\n"})
    assert submit.execute(p) == 0
    assert calls.argv == [["sinfo", "-h", "-N", "-o", "%N %P"], p.argv] and p.run.job_id() == "41"


def test_where_the_partition_is_too_small_the_argv_run_is_one_the_plan_listed(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """3 nodes, n1 and n2 bad, a 2-node job: the oldest (n1) comes back before sbatch; that argv is among the dry
    run's "may also run" lines."""
    from runner.host import nodes, submit

    nodes.record(tmp_path, ["n1"], "hang", "earlier", now=1.0e9)
    nodes.record(tmp_path, ["n2"], "hang", "earlier")
    p = submit.plan(Path(__file__).parents[1] / "conf" / "slurm-2node.yaml", [f"run_root={tmp_path}",
                                                                             "resume.exclude_nodes_s=2000000000"])
    calls = fake_slurm(monkeypatch, {"sbatch": "42\n", "sinfo": "n1 debug*\nn2 debug*\nn3 debug*\n"})
    assert submit.execute(p) == 0
    sent = ["sbatch", "--parsable", "--exclude=n2", str(p.run.script)]
    assert calls.argv[-1] == sent and f"may also run:  {' '.join(sent)}" in str(p), str(p)


def test_detect_on_this_machine() -> None:
    assert ifname.detect_ifname("127.0.0.1") == "lo"
    assert ifname.detect_ifname("no-such-host.invalid") is None
