"""Every test has exactly one tier, and a unit test asks for nothing that starts processes (tests/conftest.py).

It checks what this session collected, before `-m` deselected anything: `scripts/test.sh --unit` and the full run
collect all of tests/, a run of one file checks that file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import COLLECTED_KEY, FIXTURE_TIERS, PROBLEMS_KEY, TIER_KEY, TIERS, fixture_tier, resolve_tier

pytestmark = pytest.mark.unit


def test_every_collected_test_has_exactly_one_tier(request: pytest.FixtureRequest) -> None:
    collected = request.config.stash.get(COLLECTED_KEY, [])
    assert request.node in collected
    wrong = [f"{item.nodeid} {problem}" for item in collected for problem in item.stash[PROBLEMS_KEY]]
    assert not wrong, "\n".join(wrong)


class _Fake:
    """Just enough of a pytest item for resolve_tier: its markers by level (its own, its class's, its module's;
    closest first) and its fixtures."""

    def __init__(self, marks: list[list[str]], fixtures: list[str]) -> None:
        self.levels = [(object(), [getattr(pytest.mark, m).mark for m in level]) for level in marks]
        self.fixturenames = fixtures
        self._fixtureinfo: object = None

    def iter_markers_with_node(self) -> list[tuple[object, pytest.Mark]]:
        return [(node, mark) for node, level in self.levels for mark in level]


@pytest.mark.parametrize(("marks", "fixtures", "tier", "problem"), [
    ([["unit"]], ["tmp_path"], "unit", None),
    ([[]], ["tmp_path"], None, "has no tier"),
    ([[], ["filterwarnings"]], [], None, "has no tier"),
    ([[]], ["slurm_cluster"], "slurm", None),  # a fixture gives its tier
    ([[], ["unit"]], ["slurm_cluster"], "unit", "is in the unit tier but uses slurm_cluster (slurm)"),
    ([["local"]], ["podman_base_image"], "local", "uses podman_base_image (podman)"),
    ([["podman"]], ["slurm_cluster", "podman_base_image"], "podman", None),  # the heaviest need
    ([["local"], [], ["unit"]], [], "local", None),  # a test's own tier over its module's
    ([["unit", "local"]], [], None, "carries 2 tiers in one place (local, unit)"),
    ([[], ["slurm", "slow"]], [], None, "carries 2 tiers in one place (local, slurm)"),  # `slow`: the old `local`
    ([["slow"]], [], "local", None),
])
def test_the_tier_rules_fail_when_broken(marks: list[list[str]], fixtures: list[str], tier: str | None,
                                         problem: str | None) -> None:
    got, problems = resolve_tier(_Fake(marks, fixtures))  # type: ignore[arg-type]
    assert got == tier
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_a_fixture_marked_with_its_tier_gives_it_to_the_tests_that_use_it() -> None:
    @fixture_tier("local")
    def trains() -> None: ...

    def fake(marks: list[list[str]]) -> _Fake:
        item = _Fake(marks, ["tmp_path", "trains"])
        item._fixtureinfo = SimpleNamespace(name2fixturedefs={"trains": [SimpleNamespace(func=trains)]})
        return item

    assert resolve_tier(fake([[]])) == ("local", [])  # type: ignore[arg-type]
    tier, problems = resolve_tier(fake([[], ["unit"]]))  # type: ignore[arg-type]
    assert tier == "unit" and problems == ["is in the unit tier but uses trains (local)"]


def test_a_test_carries_its_one_tier_itself(request: pytest.FixtureRequest) -> None:
    """The module's `unit` moved onto each test, so `-m local` cannot select a unit test through its module."""
    assert [m.name for m in request.node.iter_markers() if m.name in TIERS] == ["unit"]
    assert request.node.stash[TIER_KEY] == "unit"


def test_each_fixture_tier_is_a_tier_heavier_than_unit() -> None:
    assert set(FIXTURE_TIERS.values()) <= set(TIERS) - {"unit"}


@pytest.mark.local
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
