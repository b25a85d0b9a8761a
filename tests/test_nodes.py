"""Bad-node memory: what is remembered, for how long, and what reaches sbatch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from runner import cli
from runner.host import nodes
from runner.spec.schema import SCHEMA

pytestmark = pytest.mark.unit

H = 3600.0


def test_remembered_nodes_decay_and_can_be_cleared(tmp_path: Path) -> None:
    nodes.record(tmp_path, ["n1", "n2.cluster.local"], "hang", "run-a", "rank 3 in data", now=0)
    nodes.record(tmp_path, ["n3"], "preflight", "run-b", now=5 * H)
    assert sorted(nodes.remembered(tmp_path, 6 * H, now=5 * H)) == ["n1", "n2", "n3"]
    assert sorted(nodes.remembered(tmp_path, 6 * H, now=7 * H)) == ["n3"]  # n1, n2 decayed
    assert nodes.exclude(nodes.remembered(tmp_path, 6 * H, now=5 * H)) == ["--exclude=n1,n2,n3"]
    assert nodes.clear(tmp_path, "n3", now=5 * H)
    assert not nodes.clear(tmp_path, "n9", now=5 * H)
    assert nodes.exclude(nodes.remembered(tmp_path, 6 * H, now=5 * H)) == ["--exclude=n1,n2"]
    nodes.record(tmp_path, ["n3"], "node_fail", "run-c", now=6 * H)  # bad again after a clear
    assert nodes.remembered(tmp_path, 6 * H, now=6 * H)["n3"]["cause"] == "node_fail"
    assert nodes.exclude(nodes.remembered(tmp_path, 0, now=6 * H + 1)) == []


@pytest.mark.parametrize("name", ["n1;rm -rf /", "", "-x", "n 1", "a" * 65, "n1\n"])
def test_a_name_that_is_not_a_hostname_never_reaches_sbatch(tmp_path: Path, name: str) -> None:
    assert nodes.record(tmp_path, [name], "hang", "run") == []
    assert nodes.exclude(nodes.remembered(tmp_path, H)) == []


def test_torn_and_foreign_lines_are_skipped(tmp_path: Path) -> None:
    nodes.record(tmp_path, ["n1"], "hang", "run", now=0)
    with open(nodes.path(tmp_path), "a") as f:
        f.write('[1, 2]\n{"node": 5, "time": 0}\n{"node": "n2", "ti')  # a crash mid-line
    assert list(nodes.remembered(tmp_path, H, now=1)) == ["n1"]
    nodes.record(tmp_path, ["n4"], "hang", "run", now=0)  # appending after a torn line still parses
    assert "n4" not in nodes.remembered(tmp_path, H, now=1)  # glued to the torn line: lost, never misread


def test_the_cli_lists_and_forgets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    nodes.record(tmp_path, ["n2"], "preflight", "run-x", "busbw 0.1 GB/s < 0.5 x median")
    assert cli.main(["nodes", "--root", str(tmp_path), "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)) == ["n2"]
    assert cli.main(["nodes", "--root", str(tmp_path), "--clear", "n2"]) == 0
    assert "forgotten" in capsys.readouterr().out
    assert cli.main(["nodes", "--root", str(tmp_path)]) == 0
    assert "no nodes" in capsys.readouterr().out


def test_the_cli_default_window_is_the_config_default() -> None:
    sp = cli.parser().parse_args(["nodes"])
    assert sp.forget_after_s == SCHEMA["resume"]["exclude_nodes_s"].default


def test_an_unreadable_memory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.mkdir(nodes.path(tmp_path))  # a directory where the file should be
    assert cli.main(["nodes", "--root", str(tmp_path)]) == 1  # not bad input: the environment
    err = capsys.readouterr().err
    assert "unreadable" in err and len(err.strip().splitlines()) == 1


BLAME = [
    # (outcome, report, nodes blamed)
    ("hang", {"attempt": 2, "world": 4, "suspects": [{}], "nodes": ["n2"]}, ["n2"]),
    ("hang", {"attempt": 2, "world": 2, "suspects": [{}], "nodes": ["n1"]}, ["n1"]),  # one node, one rank of two
    ("hang", {"attempt": 1, "world": 4, "suspects": [{}], "nodes": ["n2"]}, []),  # an older attempt's report
    ("hang", {"attempt": 2, "world": 2, "suspects": [{}, {}], "nodes": ["n1", "n2"]}, []),  # every rank
    ("preflight_failed", {"nodes": ["n1", "n2", "n3"], "checks": [
        {"node": "n2", "status": "fail"}, {"node": "n1", "status": "pass"}]}, ["n2"]),
    ("preflight_failed", {"nodes": ["n1", "n2"], "checks": [
        {"node": "n1", "status": "fail"}, {"node": "n2", "status": "fail"}]}, []),  # every node: the job's fault
    ("preflight_failed", {"nodes": ["n1"], "checks": [{"node": "n1;reboot", "status": "fail"}]}, []),
    ("failed", {"nodes": ["n1"]}, []),
    ("hang", None, []),
]


@pytest.mark.parametrize(("outcome", "report", "blamed"), BLAME)
def test_which_nodes_a_report_blames(outcome: str, report: object, blamed: list[str]) -> None:
    assert nodes.named_by(outcome, report, 2) == blamed


@pytest.mark.parametrize("bad, have, needed, let_in", [
    (["n1"], ["n1", "n2"], 2, 1),  # a 2-node job on a 2-node partition: the one bad node must come back
    (["n1"], ["n1", "n2"], 1, 0),  # n2 holds a 1-node job
    (["n1", "n2"], ["n1", "n2"], 1, 1),  # the oldest (n1) back in, n2 stays out
    (["n1", "n2"], ["n1", "n2", "n3"], 2, 1),
    (["n9", "n1"], ["n1", "n2"], 2, 2),  # n9 is not the partition's: it counts for nothing either way
    (["n1"], None, 2, 0),  # Slurm could not say: sbatch decides (and its refusal lets nodes in)
    (["n1", "n2"], ["n1", "n2"], 3, 2),  # no exclusion makes room: all back in, sbatch says why it refuses
])
def test_the_oldest_bad_nodes_come_back_before_sbatch_when_the_partition_is_too_small(
        bad: list[str], have: list[str] | None, needed: int, let_in: int) -> None:
    assert nodes.let_in_first(bad, have, needed) == let_in


@pytest.mark.parametrize("partition, found", [(None, ["n1", "n2"]), ("gpu", ["g1", "n2"]), ("nope", None)])
def test_a_partitions_nodes_from_sinfo(partition: str | None, found: list[str] | None) -> None:
    from runner.host import slurm

    out = "n1 debug*\nn2 debug*\nn2 gpu\ng1 gpu\n\n"
    assert slurm.parse_partition_nodes(out, partition) == found
