"""The dev cluster's own logic without a cluster (the unit tier; the real cluster: tests/test_devcluster.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runner.dev import devcluster
from runner.errors import ClusterError

pytestmark = pytest.mark.unit


def test_up_needs_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ClusterError, match="root"):
        devcluster.up()


def test_up_names_missing_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(devcluster.shutil, "which", lambda cmd: None)
    with pytest.raises(ClusterError, match="install-slurm.sh"):
        devcluster.up()


def test_slurm_conf_has_fast_settings(tmp_path: Path) -> None:
    p = devcluster._Paths(tmp_path)
    cluster = devcluster.Cluster(root=tmp_path, conf=p.conf, nodes=["n1", "n2"],
                                 addresses={"n1": "10.77.0.1", "n2": "10.77.0.2"},
                                 netns={"n1": "rdc-n1", "n2": "rdc-n2"})
    conf = devcluster._render_slurm_conf(p, cluster, "proctrack/cgroup")
    for setting in ("KillWait=2", "cred_expire=5", "JobRequeue=1", "sched_interval=1",
                    "SlurmdParameters=config_overrides", "JobCompType=jobcomp/filetxt",
                    "NodeName=n2 NodeHostname=n2 NodeAddr=10.77.0.2", "Gres=gpu:2",
                    "PartitionName=dev Nodes=n1,n2 Default=YES"):
        assert setting in conf
    gres = devcluster._render_gres_conf(p, cluster)
    assert gres.startswith("AutoDetect=off\n")
    assert f"NodeName=n1 Name=gpu File={tmp_path}/nodes/n1/dev/nvidia1" in gres
