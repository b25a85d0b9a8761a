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


@contextlib.contextmanager
def dev_cluster(nodes: int, restore: bool = False) -> Iterator[Any]:
    """Under the session lock: the dev cluster with ``nodes`` nodes (2 fake GPUs each), SLURM_CONF pointing at it.

    A healthy cluster of that shape that was already up is reused and left running. Otherwise the one started here
    is torn down afterwards, even when tests fail; with ``restore``, a cluster of another shape that was up before is
    brought back instead (a module that needs more nodes than the session's cluster).
    """
    _install()
    from runner.dev import devcluster
    from runner.errors import ClusterError

    with _session_lock(devcluster.resolve_root()):
        before = devcluster.running()
        try:
            cluster = devcluster.up(nodes=nodes, gpus_per_node=2)
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
            if before != cluster and restore and before is not None:
                devcluster.up(nodes=len(before.nodes), gpus_per_node=before.gpus_per_node,
                              cpus_per_node=before.cpus_per_node)
            elif before != cluster:
                devcluster.down(cluster.root)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Any]:
    """A running `runner.dev.devcluster.Cluster` of 2 nodes; SLURM_CONF points at it for the session."""
    with dev_cluster(2) as cluster:
        yield cluster
