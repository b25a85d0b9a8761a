"""Shared fixtures and the test tiers.

Real services (Slurm cluster, webhook server, podman) are pytest plugins in tests/.

Every test belongs to exactly one tier, a marker that says what it needs (`pytest -m unit`, `scripts/test.sh --unit`):

- ``unit``: in-process only, starts no process; the whole tier runs in under a minute on 2 cores.
- ``local``: starts local processes (training ranks, the CLI, linters, tmux).
- ``browser``: opens a page in headless Chromium.
- ``slurm``: needs the local dev Slurm cluster (root).
- ``podman``: needs podman and its local base image (root); some of these use the dev cluster as well.

One tier per file: a module says its tier with ``pytestmark = pytest.mark.<tier>``, and a test of another tier goes
to a sibling file named for it (``test_x.py``, ``test_x_unit.py``, ``test_x_local.py``, ``test_x_cluster.py`` for
slurm, ``test_x_podman.py``, ``test_x_browser.py``), importing the helpers it shares. So ``pytest tests/test_x.py``
runs one tier, and a split file's siblings say theirs by name. A test may still say its tier itself, and one that says
none and uses a fixture of a heavier tier (`slurm_cluster`, `podman_base_image`, a fixture marked
``@fixture_tier("local")``) gets that tier: either way it must be its file's. tests/test_tiers.py fails when a test has
no tier, two, or is a unit test that asks for a process-starting fixture, and when a file holds tests of two tiers; a
unit test that starts a process anyway fails at teardown.
"""

from __future__ import annotations

import _posixsubprocess
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest_plugins = ["tests.webhook_server", "tests.slurm_fixture", "tests.podman_fixture", "tests.leftovers"]

# Lightest first: a test that needs several things is in the tier of the heaviest.
TIERS = {
    "unit": "in-process only, starts no process; under a minute on 2 cores (scripts/test.sh --unit)",
    "local": "starts local processes: training ranks, the CLI, linters, tmux",
    "browser": "opens a page in headless Chromium (scripts/install-chromium.sh, root)",
    "slurm": "needs the local dev Slurm cluster (root + scripts/install-slurm.sh)",
    "podman": "needs podman and its local base image (root + scripts/install-podman.sh); some use the dev cluster too",
}
# The old name of the local tier, still read so that a test written with it keeps one tier.
ALIASES = {"slow": "local"}
# Fixtures that put every test using them (directly or through another fixture) in at least this tier; a test
# module's own fixture says its tier with `@fixture_tier(...)`.
FIXTURE_TIERS = {
    "slurm_cluster": "slurm",
    "podman_base_image": "podman",
}
F = TypeVar("F", bound=Callable[..., Any])


def fixture_tier(tier: str) -> Callable[[F], F]:
    """Under `@pytest.fixture`: the tier of every test that uses this fixture is at least `tier` (a fixture that
    starts training processes: "local"; one that starts its own cluster: "slurm")."""
    assert tier in TIERS, tier

    def mark(fn: F) -> F:
        fn.runner_tier = tier  # type: ignore[attr-defined]
        return fn
    return mark


def _fixture_tiers(item: pytest.Item) -> dict[str, str]:
    """The fixtures this test uses (directly or through another fixture) that put it in a tier."""
    found = {f: FIXTURE_TIERS[f] for f in getattr(item, "fixturenames", ()) if f in FIXTURE_TIERS}
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
        if defs and (tier := getattr(defs[-1].func, "runner_tier", None)):
            found[name] = tier
    return found


TIER_KEY = pytest.StashKey[str]()
PROBLEMS_KEY = pytest.StashKey[list[str]]()
COLLECTED_KEY = pytest.StashKey[list[pytest.Item]]()


def pytest_addoption(parser):  # type: ignore[no-untyped-def]
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden/* from the templates")


def pytest_configure(config: pytest.Config) -> None:
    for name, needs in TIERS.items():
        config.addinivalue_line("markers", f"{name}: tier: {needs}")
    config.addinivalue_line("markers", "slow: the old name of the `local` tier")


def _rank(tier: str) -> int:
    return list(TIERS).index(tier)


def _tier_name(mark: pytest.Mark) -> str | None:
    return ALIASES.get(mark.name, mark.name) if mark.name in TIERS or mark.name in ALIASES else None


def resolve_tier(item: pytest.Item) -> tuple[str | None, list[str]]:
    """The tier of a test and what is wrong with it. The closest tier marker wins (a test's own over its class's
    over its module's); one place naming two tiers, no tier at all, or a fixture of a heavier tier is wrong."""
    said: list[str] = []
    said_at = None
    for node, mark in item.iter_markers_with_node():
        name = _tier_name(mark)
        if name is None:
            continue
        if said and node is not said_at:
            break
        said_at = node
        if name not in said:
            said.append(name)
    needed = _fixture_tiers(item)
    heaviest = max(needed.values(), key=_rank, default=None)
    problems = []
    if len(said) > 1:
        problems.append(f"carries {len(said)} tiers in one place ({', '.join(sorted(said))}); a test has exactly one")
    tier = (said[0] if len(said) == 1 else None) if said else heaviest
    if tier is None and not said:
        problems.append("has no tier: add `pytestmark = pytest.mark.<tier>` to its module (tests/conftest.py)")
    elif tier is not None and heaviest is not None and _rank(heaviest) > _rank(tier):
        uses = ", ".join(f"{f} ({t})" for f, t in needed.items() if _rank(t) > _rank(tier))
        problems.append(f"is in the {tier} tier but uses {uses}")
    return tier, problems


def mixed_files(tiers: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """The files whose tests are of more than one tier, each with those tiers (lightest first), from (file, tier)
    pairs; a test without a tier ("") is left to resolve_tier's problems."""
    found: dict[str, set[str]] = {}
    for path, tier in tiers:
        if tier:
            found.setdefault(path, set()).add(tier)
    return {path: sorted(held, key=_rank) for path, held in found.items() if len(held) > 1}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the tiers are checked over everything collected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    carried = {}
    for item in items:
        tier, problems = resolve_tier(item)
        item.stash[TIER_KEY] = tier or ""
        item.stash[PROBLEMS_KEY] = problems
        carried[item] = [tier] if tier else sorted({n for m in item.iter_markers() if (n := _tier_name(m))})
    # Each test then carries its tier itself, and its class and module none: `-m unit` must not select a test of a
    # unit module that says `@pytest.mark.local` (a test with two keeps both, for test_tiers to report).
    for item in items:
        for node in item.listchain():
            node.own_markers[:] = [m for m in node.own_markers if _tier_name(m) is None]
        for name in carried[item]:
            item.add_marker(name)
    config.stash[COLLECTED_KEY] = list(items)


@pytest.fixture(autouse=True)
def _fresh_runner_logger() -> Iterator[None]:
    """`runner.log.setup` (called by every CLI entry) configures the process-wide `runner` logger; a test that
    ran `cli.main` must not change what the next test's caplog sees."""
    logger = logging.getLogger("runner")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


# Every way Python starts a process ends in one of these: subprocess.Popen calls its own name for
# _posixsubprocess.fork_exec (or os.posix_spawn), multiprocessing's spawn and forkserver call fork_exec, its fork
# context os.fork.
_STARTERS: list[tuple[Any, str]] = [(subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"),
                                    (os, "system"), (os, "posix_spawn"), (os, "posix_spawnp")]


@pytest.fixture(autouse=True)
def _unit_starts_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """A unit test that starts a process fails: it belongs in the local tier (the unit tier stays fast)."""
    if request.node.stash.get(TIER_KEY, "") != "unit":
        yield
        return
    started: list[str] = []

    def recording(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def starter(*args: Any, **kwargs: Any) -> Any:
            argv = args[0] if name in ("_fork_exec", "fork_exec", "system") and args else args[1:2]
            started.append(f"{name.lstrip('_')}({argv!r:.120})")
            return real(*args, **kwargs)
        return starter

    saved = [(owner, name, getattr(owner, name)) for owner, name in _STARTERS if hasattr(owner, name)]
    for owner, name, real in saved:
        setattr(owner, name, recording(name, real))
    try:
        yield
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)
    if started:
        pytest.fail(f"a unit test started {len(started)} process(es), first {started[0]}: mark it "
                    "`@pytest.mark.local` (or its module `pytestmark = pytest.mark.local`)", pytrace=False)


TIME_KEY = pytest.StashKey[dict[str, list[float]]]()


def _cpu_ticks() -> tuple[int, int]:
    """The machine's (busy, all) CPU ticks since boot, from /proc/stat's first line (idle and iowait are not busy)."""
    try:
        fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(fields) - sum(fields[3:5]), sum(fields)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Each test's whole time (setup, call, teardown) counts to its tier, for the summary below. With
    RUNNER_TEST_TIMES=FILE each test also appends a line to FILE as it ends (seconds, the share of the machine's CPU
    busy meanwhile, tier, test id): a run killed halfway still says where its time went, and a test that mostly waits
    (low CPU) is told from one that computes."""
    log = os.environ.get("RUNNER_TEST_TIMES")
    start, (busy, total) = time.monotonic(), _cpu_ticks() if log else (0, 0)
    try:
        return (yield)
    finally:
        spent = time.monotonic() - start
        tier = item.stash.get(TIER_KEY, "") or "none"
        item.config.stash.setdefault(TIME_KEY, {}).setdefault(tier, []).append(spent)
        if log:
            busy2, total2 = _cpu_ticks()
            share = (busy2 - busy) / (total2 - total) if total2 > total else 0.0
            with open(log, "a") as out:
                out.write(f"{spent:.1f}\t{share:.2f}\t{tier}\t{item.nodeid}\n")


def _summary_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_sessionstart(session: pytest.Session) -> None:
    """A run stopped by SIGTERM (CI's time limit) ends as an interrupted one: pytest still prints the slowest tests
    and the time per tier, so a run that ran out of time says where its time went."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _summary_on_sigterm)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """One line per tier: how many tests ran and how long they took, so that growth is seen (scripts/test.sh)."""
    times = config.stash.get(TIME_KEY, {})
    if not times:
        return
    terminalreporter.section("time per tier")
    for tier in [*TIERS, *sorted(set(times) - set(TIERS))]:
        if tier in times:
            spent = times[tier]
            terminalreporter.write_line(f"{tier:8} {len(spent):5} tests {sum(spent):8.1f} s"
                                        f"  (slowest {max(spent):.1f} s)")
