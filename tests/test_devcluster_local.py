"""The dev cluster's node states read from a stand-in sinfo script (the local tier; the real cluster:
tests/test_devcluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.dev import devcluster
from runner.errors import ClusterError

pytestmark = pytest.mark.local


def test_node_states_need_an_answer_from_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sinfo refusing means "not ready yet" (up() keeps waiting); no sinfo at all is an error at once."""
    cluster = devcluster.Cluster(root=tmp_path, conf=tmp_path / "slurm.conf", nodes=["n1"],
                                 addresses={"n1": "10.77.0.1"}, netns={"n1": "rdc-n1"})
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ClusterError, match="sinfo: command not found"):
        devcluster._sinfo_states(cluster)
    sinfo = tmp_path / "sinfo"
    sinfo.write_text("#!/bin/sh\nexit 1\n")
    sinfo.chmod(0o755)
    assert devcluster._sinfo_states(cluster) is None
    sinfo.write_text(f'#!/bin/sh\n[ "$SLURM_CONF" = "{cluster.conf}" ] || exit 1\necho "n1 idle"\necho "n2 down*"\n')
    assert devcluster._sinfo_states(cluster) == {"n1": "idle", "n2": "down*"}
