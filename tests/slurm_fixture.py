"""pytest plugin: a real 2-node Slurm cluster (2 fake GPUs per node) for the whole session.

Load it from tests/conftest.py with `pytest_plugins = ["tests.slurm_fixture"]`. Tests that use
the `slurm_cluster` fixture are skipped with a reason on a developer machine that is not root or
cannot install Slurm, and fail instead when CI=true: CI must never skip them silently.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALL_SCRIPT = REPO / "scripts" / "install-slurm.sh"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slurm: needs the local dev Slurm cluster (root + scripts/install-slurm.sh)")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _unavailable(reason: str) -> None:
    if _in_ci():
        pytest.fail(f"dev Slurm cluster unavailable in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def _install() -> None:
    """Run the idempotent installer (0.1 s when everything is there)."""
    if os.geteuid() != 0:
        _unavailable("the dev Slurm cluster needs root; run the tests as root "
                     "after `sudo scripts/install-slurm.sh`")
    proc = subprocess.run(["sh", str(INSTALL_SCRIPT)], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()
        _unavailable(f"scripts/install-slurm.sh failed: {last[-1] if last else proc.returncode}")


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[object]:
    """A running `runner.devcluster.Cluster`; SLURM_CONF points at it for the session.

    A healthy cluster that was already up before the session (same shape) is reused and left
    running; one started here is always torn down, even when tests fail.
    """
    _install()
    from runner import devcluster
    from runner.errors import ClusterError

    before = devcluster.running()
    try:
        cluster = devcluster.up(nodes=2, gpus_per_node=2)
    except ClusterError as exc:
        _unavailable(str(exc))
        raise  # unreachable: _unavailable skips or fails
    started_here = before != cluster
    old_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf
        if started_here:
            devcluster.down(cluster.root)
