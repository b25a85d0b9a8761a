"""No process a test started outlives it (a pytest plugin, loaded by tests/conftest.py).

A test that fails halfway can leave its processes behind: a local run of 100,000 steps whose cancel never came, a
Slurm job's ranks. On 2 cores such a leftover slows every test after it, and the suite then runs out of CI's time
instead of reporting the one failure. So each test's call runs with ``RUNNER_TEST_PROCESS=<token>`` in the environment,
which every process it starts inherits (a Slurm job too: sbatch exports the environment); once the test and its
fixtures are done, what still carries the token is killed, and the summary names it.

Not killed: the dev cluster's daemons (a test that revives a node restarts its slurmd, which the next tests use).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import ended

MARK = "RUNNER_TEST_PROCESS"
DAEMONS = {"slurmctld", "slurmd", "slurmdbd", "slurmstepd", "munged", "mariadbd"}
TOKEN_KEY = pytest.StashKey[str]()
LEFT_KEY = pytest.StashKey[list[str]]()
_tokens = itertools.count()


def marked(token: str) -> dict[int, str]:
    """The live processes (not daemons) started under ``token``: pid -> command line."""
    needle = f"{MARK}={token}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "comm").read_text().strip() in DAEMONS:
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    token = f"{os.getpid()}-{next(_tokens)}"
    item.stash[TOKEN_KEY] = token
    os.environ[MARK] = token
    try:
        return (yield)
    finally:
        os.environ.pop(MARK, None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    try:
        return (yield)  # the test's fixtures end their own processes first
    finally:
        token = item.stash.get(TOKEN_KEY, None)
        left = marked(token) if token else {}
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(AssertionError):  # one that will not die (in D state) is named all the same
            ended(list(left), timeout=10)
        if left:
            item.config.stash.setdefault(LEFT_KEY, []).append(
                f"{item.nodeid}: {len(left)} killed, first {next(iter(left.values()))[:160]}")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    left = config.stash.get(LEFT_KEY, [])
    if left:
        terminalreporter.section("processes left by tests (killed after the test)")
        for line in left:
            terminalreporter.write_line(line)
