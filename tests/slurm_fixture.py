"""pytest plugin: a real 2-node Slurm cluster (2 fake GPUs per node) for the whole session.

Load it from tests/conftest.py with `pytest_plugins = ["tests.slurm_fixture"]`. Tests that use
the `slurm_cluster` fixture are skipped with a reason on a developer machine that is not root or
cannot install Slurm, and fail instead when CI=true: CI must never skip them silently.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ci import unavailable
from tests.waiting import until

REPO = Path(__file__).resolve().parents[1]
INSTALL_SCRIPT = REPO / "scripts" / "install-slurm.sh"


def _install() -> None:
    """Run the idempotent installer (0.1 s when everything is there)."""
    if os.geteuid() != 0:
        unavailable("the dev Slurm cluster needs root; run the tests as root "
                     "after `sudo scripts/install-slurm.sh`")
    proc = subprocess.run(["sh", str(INSTALL_SCRIPT)], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()
        unavailable(f"scripts/install-slurm.sh failed: {last[-1] if last else proc.returncode}")


_HELD: list[Path] = []  # this process holds the lock already (flock would wait for itself on a second open)


@contextlib.contextmanager
def _session_lock(root: Path, timeout: float = 1800) -> Iterator[None]:
    """Hold the machine's one cluster for this session: another pytest session waits here
    instead of having the cluster torn down under its running tests. Re-entrant within one session."""
    if root in _HELD:
        yield
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{root}.session.lock", "a") as f:
        def locked() -> bool:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True
        try:
            until("the dev cluster's session lock", locked, timeout, every=0.5)
        except AssertionError:
            unavailable(f"another test session held the dev cluster for {timeout:g}s")
        _HELD.append(root)
        try:
            yield
        finally:
            _HELD.remove(root)
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Any]:
    """A running `runner.dev.devcluster.Cluster`; SLURM_CONF points at it for the session.

    A healthy cluster that was already up before the session (same shape) is reused and left
    running; one started here is always torn down, even when tests fail.
    """
    _install()
    from runner.dev import devcluster
    from runner.errors import ClusterError

    with _session_lock(devcluster.resolve_root()):
        before = devcluster.running()
        try:
            cluster = devcluster.up(nodes=2, gpus_per_node=2)
        except ClusterError as exc:
            unavailable(str(exc))
            raise  # not reached: unavailable() skips or fails
        old_conf = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(cluster.conf)
        try:
            yield cluster
        finally:
            if old_conf is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old_conf
            if before != cluster:
                devcluster.down(cluster.root)
