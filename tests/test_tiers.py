"""Every test has exactly one tier, every file holds tests of one tier, and a unit test asks for nothing that starts
processes (tests/conftest.py).

It checks what this session collected, before `-m` deselected anything: `scripts/test.sh --unit` and the full run
collect all of tests/, a run of one file checks that file.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.conftest import (
    COLLECTED_KEY,
    FIXTURE_TIERS,
    PROBLEMS_KEY,
    TIER_KEY,
    TIERS,
    fixture_tier,
    mixed_files,
    resolve_tier,
)

pytestmark = pytest.mark.unit


def test_every_collected_test_has_exactly_one_tier(request: pytest.FixtureRequest) -> None:
    collected = request.config.stash.get(COLLECTED_KEY, [])
    assert request.node in collected
    wrong = [f"{item.nodeid} {problem}" for item in collected for problem in item.stash[PROBLEMS_KEY]]
    assert not wrong, "\n".join(wrong)


def test_each_collected_file_holds_tests_of_one_tier(request: pytest.FixtureRequest) -> None:
    """A file's name says what its tests need: the tests of a second tier go to a sibling file named for it."""
    collected = request.config.stash.get(COLLECTED_KEY, [])
    mixed = mixed_files((item.nodeid.split("::")[0], item.stash[TIER_KEY]) for item in collected)
    assert not mixed, "\n".join(f"{path} holds tests of {len(tiers)} tiers ({', '.join(tiers)}): move the {tier} ones "
                                f"to a sibling file named for it (tests/conftest.py)"
                                for path, tiers in mixed.items() for tier in tiers[1:])


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


@pytest.mark.parametrize(("tests", "mixed"), [
    ([("test_a.py", [[], ["unit"]], []), ("test_a.py", [[], ["unit"]], ["tmp_path"])], {}),
    ([("test_a.py", [[], ["unit"]], []), ("test_a.py", [["local"], ["unit"]], [])],  # a test says its own
     {"test_a.py": ["unit", "local"]}),
    ([("test_a.py", [[], ["unit"]], []), ("test_a_local.py", [[], ["local"]], [])], {}),  # moved to its sibling
    ([("test_a.py", [[]], ["slurm_cluster"]), ("test_a.py", [["podman"]], []), ("test_b.py", [["unit"]], [])],
     {"test_a.py": ["slurm", "podman"]}),  # a tier from a fixture counts as any other
    ([("test_a.py", [[], ["local"]], []), ("test_a.py", [[]], [])], {}),  # no tier: the rule above reports it
])
def test_a_file_with_tests_of_two_tiers_is_caught(tests: list[tuple[str, list[list[str]], list[str]]],
                                                  mixed: dict[str, list[str]]) -> None:
    tiers = [(path, resolve_tier(_Fake(marks, fixtures))[0] or "")  # type: ignore[arg-type]
             for path, marks, fixtures in tests]
    assert mixed_files(tiers) == mixed


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
