"""Preflight on the real local Slurm cluster (nodes in network namespaces): it names the culprit in seconds.

Each test runs `runner preflight` (a short sbatch job through the real batch script and srun) on a 3-node
cluster, one task per node, and breaks one thing for real: a tc tbf rate limit on one node's link, a wrong
interface name, an iptables rule on the master node that drops connections to MASTER_PORT, a dataset that
is missing from one node's own mount namespace.

The cluster is reshaped to 3 nodes under the machine-wide session lock (tests/slurm_fixture.py) and put back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ci import need
from tests.conftest import fixture_tier
from tests.waiting import until

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf" / "slurm-2node.yaml"
NODES = 3
# One task per node keeps 3 nodes on 2 cores; the batch arithmetic of the 2-node config follows the world size.
SHAPE = [f"num_nodes={NODES}", "num_device=1", f"global_batch_size={8 * NODES}",
         f"dataloader.train.total_shards={NODES}", f"dataloader.valid.total_shards={NODES}"]
SLOW_NODE, SLOW_MBIT = "n3", 200  # 200 Mbit/s = 0.025 GB/s
MIN_BUSBW = 0.1  # GB/s: far below what an unlimited veth carries here, 4x above the limited link
# An empty resolv.conf for the nodes: the namespaces cannot reach the host's DNS server, and c10d's first
# TCPStore waits 10 s on a reverse lookup that times out. A real cluster's DNS answers (or fails) at once.
NO_DNS = Path("/tmp/runner-preflight-no-dns.conf")
pytestmark = pytest.mark.slurm




def in_node(cluster: Any, node: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """Run a command in the node's own network and mount namespaces (those of its slurmd, i.e. its jobs)."""
    pid = (cluster.root / "nodes" / node / "slurmd.pid").read_text().strip()
    return subprocess.run(["nsenter", "-t", pid, "-n", "-m", *argv], capture_output=True, text=True, timeout=10,
                          check=True)


@pytest.fixture(scope="module")
@fixture_tier("slurm")
def cluster() -> Iterator[Any]:
    need(os.geteuid() == 0, "the dev Slurm cluster needs root")
    need(shutil.which("iptables") is not None, "iptables is needed to block MASTER_PORT")
    from tests.slurm_fixture import _install, _session_lock

    _install()
    from runner.dev import devcluster

    with _session_lock(devcluster.resolve_root()):  # one user of the machine's one cluster at a time
        yield from _three_nodes(devcluster)


def _three_nodes(devcluster: Any) -> Iterator[Any]:
    before = devcluster.running()
    c = devcluster.up(nodes=NODES)
    NO_DNS.write_text("")
    for node in c.nodes:
        in_node(c, node, "mount", "--bind", str(NO_DNS), "/etc/resolv.conf")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(c.conf)
    try:
        yield c
    finally:
        for node in c.nodes:
            devcluster.unlimit_link(c, node)
        os.environ.pop("SLURM_CONF") if old is None else os.environ.__setitem__("SLURM_CONF", old)
        if before is None:
            devcluster.down()
        elif before != c:  # leave the shared cluster as we found it
            devcluster.up(nodes=len(before.nodes), gpus_per_node=before.gpus_per_node)
        else:
            for node in c.nodes:
                in_node(c, node, "umount", "/etc/resolv.conf")


def preflight(root: Path, *overrides: str, wait: float = 120) -> tuple[subprocess.CompletedProcess[str],
                                                                          dict[str, Any], float]:
    """`runner preflight` on the cluster: (the CLI's result, preflight.json, seconds from submit to report)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "runner", "preflight", str(CONF), f"run_root={root}", *SHAPE,
                          *overrides, "--wait", str(wait)], capture_output=True, text=True, env=env,
                         timeout=wait + 60)
    seconds = time.monotonic() - t
    runs = sorted(root.glob("slurm-2node-preflight-*"))
    assert runs, out.stdout + out.stderr
    report = json.loads((runs[-1] / "preflight.json").read_text()) if (runs[-1] / "preflight.json").exists() else {}
    return out, report, seconds


def failed(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in report["checks"] if c["status"] == "fail"]


def test_rate_limited_node_is_named_with_its_bandwidth_and_passes_without_the_limit(cluster: Any,
                                                                                     tmp_path: Path) -> None:
    from runner.dev import devcluster

    devcluster.limit_link(cluster, SLOW_NODE, SLOW_MBIT)
    try:
        out, report, _ = preflight(tmp_path, f"preflight.min_busbw_gbps={MIN_BUSBW}")
    finally:
        devcluster.unlimit_link(cluster, SLOW_NODE)
    assert out.returncode == 77, out.stdout + out.stderr
    bad = [c for c in failed(report) if c["name"] == "busbw node"]
    assert [c["node"] for c in bad] == [SLOW_NODE], out.stdout
    measured = float(bad[0]["value"].split()[0])
    assert 0.5 * SLOW_MBIT / 8000 < measured < SLOW_MBIT / 8000 * 1.1  # the tbf rate, in GB/s
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("busbw node") and " fail " in ln)
    assert f" {SLOW_NODE} " in line and bad[0]["value"] in line  # the printed table names it too
    assert report["duration_s"] < 15

    # Without the limit: no node warns either. Warned at half the median, not the default 0.8: three namespaced
    # nodes on two shared cores measure up to 0.8 apart under a loaded CI (seen once: a spurious warn), while the
    # limit above put its node far below half.
    out, report, _ = preflight(tmp_path, f"preflight.min_busbw_gbps={MIN_BUSBW}", "preflight.warn_below_median=0.5")
    assert out.returncode == 0, out.stdout + out.stderr
    nodes = {c["node"]: float(c["value"].split()[0]) for c in report["checks"] if c["name"] == "busbw node"}
    assert sorted(nodes) == ["n1", "n2", "n3"] and min(nodes.values()) > MIN_BUSBW
    assert report["status"] == "pass" and report["duration_s"] < 15, [c for c in report["checks"]
                                                                       if c["status"] != "pass"]


def test_wrong_interface_fails_in_seconds_naming_it_and_the_existing_ones(cluster: Any, tmp_path: Path) -> None:
    out, report, seconds = preflight(tmp_path, "network.ifname=eth9")
    assert out.returncode == 77, out.stdout + out.stderr
    bad = [c for c in failed(report) if c["name"] == "interface"]
    assert sorted(c["node"] for c in bad) == ["n1", "n2", "n3"]
    for c in bad:
        assert c["value"] == "eth9 not found"
        assert "eth0 (10.77.0." in c["hint"] and "lo (127.0.0.1)" in c["hint"]
    assert report["backend"] is None  # no process group was tried on a bad interface
    assert report["duration_s"] < 5 and seconds < 30
    assert "eth9 not found" in out.stdout


def test_blocked_master_port_fails_in_seconds(cluster: Any, tmp_path: Path) -> None:
    # A firewall on the master node drops inbound connections to the rendezvous port range (MASTER_PORT is
    # derived from the job id below the ephemeral range; Slurm's own ports and srun's stay open).
    rule = ["INPUT", "-i", "eth0", "-p", "tcp", "--dport", "10000:30000", "-j", "DROP"]
    in_node(cluster, "n1", "iptables", "-A", *rule)
    try:
        out, report, seconds = preflight(tmp_path, "preflight.timeout_s=5")
    finally:
        in_node(cluster, "n1", "iptables", "-D", *rule)
    assert out.returncode == 77, out.stdout + out.stderr
    port = int(report["master"].split(":")[1])
    assert 10000 <= port <= 30000
    bad = [c for c in failed(report) if c["name"] == "reach master"]
    assert sorted(c["node"] for c in bad) == ["n2", "n3"], out.stdout
    assert all("timed out" in c["value"] and f"n1:{port}" in c["value"] for c in bad)
    assert report["duration_s"] < 15 and seconds < 45


def test_dataset_missing_on_one_node_names_that_node(cluster: Any, tmp_path: Path) -> None:
    # The dataset is staged on the shared filesystem, but n2 has its own scratch mount over the folder
    # (as a node-local disk would): only n2's jobs miss the file.
    data = Path(f"/tmp/runner-preflight-data-{os.getpid()}")
    data.mkdir(exist_ok=True)
    (data / "train.bin").write_bytes(b"\0" * 1024)
    in_node(cluster, "n2", "mount", "-t", "tmpfs", "scratch", str(data))
    try:
        out, report, _ = preflight(tmp_path, f"preflight.paths=[{data / 'train.bin'}]")
    finally:
        in_node(cluster, "n2", "umount", str(data))
        shutil.rmtree(data)
    assert out.returncode == 77, out.stdout + out.stderr
    bad = [c for c in failed(report) if c["name"] == "path"]
    assert [(c["node"], c["value"]) for c in bad] == [("n2", f"{data / 'train.bin'} missing")]
    assert [c["node"] for c in report["checks"] if c["name"] == "path" and c["status"] == "pass"] == ["n1", "n3"]


def test_one_40_mbit_link_stops_the_job_by_default_in_seconds(cluster: Any, tmp_path: Path) -> None:
    """No threshold configured: a node at a few % of the median fails (not warns), the probe stops early on its
    link and names it, and `runner preflight` answers within 15 s from submission."""
    from runner.dev import devcluster

    devcluster.limit_link(cluster, SLOW_NODE, 40)  # 40 Mbit/s = 0.005 GB/s
    try:
        out, report, seconds = preflight(tmp_path)
    finally:
        devcluster.unlimit_link(cluster, SLOW_NODE)
    print(f"runner preflight with one 40 Mbit link: {seconds:.1f} s from submit to report, "
          f"{report.get('duration_s')} s in the job")
    assert out.returncode == 77, out.stdout + out.stderr
    bad = [c for c in failed(report) if c["name"] == "busbw node"]
    assert [c["node"] for c in bad] == [SLOW_NODE], out.stdout
    assert bad[0]["threshold"].startswith(">= 0.5 x median")
    assert "probe stopped early on a slow link" in bad[0]["note"] and SLOW_NODE in bad[0]["note"]
    assert float(bad[0]["value"].split()[0]) < 2 * 40 / 8000  # the tbf rate (0.005 GB/s), not the veth's
    assert seconds < 15, seconds


def test_a_node_that_fails_the_preflight_is_left_out_and_the_run_finishes(cluster: Any, tmp_path: Path) -> None:
    """A 2-node training run on the 3-node cluster; n2 misses the dataset. The job stops before its first step,
    names n2, remembers it under the run root and resubmits itself without it; the next job trains on n1 and n3."""
    from runner.host import nodes

    data = Path(f"/tmp/runner-preflight-data-{os.getpid()}")
    data.mkdir(exist_ok=True)
    (data / "train.bin").write_bytes(b"\0" * 1024)
    in_node(cluster, "n2", "mount", "-t", "tmpfs", "scratch", str(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        subprocess.run([sys.executable, "-m", "runner", "submit", str(CONF), f"run_root={tmp_path}", "num_nodes=2",
                        "num_device=1", "global_batch_size=16", "dataloader.train.total_shards=2",
                        "dataloader.valid.total_shards=2", "trainer.max_steps=20", "resume.backoff_s=0",
                        f"preflight.paths=[{data / 'train.bin'}]"], check=True, capture_output=True, env=env,
                       timeout=60)
        [run] = tmp_path.glob("slurm-2node-*")

        def events() -> list[dict[str, Any]]:
            return [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]

        until("the resubmission (the exit hook records the exit, then resubmits)",
              lambda: any(e["event"] == "resubmitted" for e in events()), 120, every=0.5,
              detail=lambda: (run / "ledger.jsonl").read_text())
        status = subprocess.run([sys.executable, "-m", "runner", "status", str(run), "--json"], check=True,
                                capture_output=True, text=True, env=env, timeout=60)
        row = json.loads(status.stdout)[0]
        assert row["last_outcome"] == "preflight_failed", (run / "ledger.jsonl").read_text()
        assert row["last_cause"].startswith("node: n2 failed the preflight"), row["last_cause"]
        assert list(nodes.remembered(tmp_path, 3600)) == ["n2"]
        [again] = [e for e in events() if e["event"] == "resubmitted"]
        show = subprocess.run(["scontrol", "show", "job", again["job_id"]], capture_output=True, text=True,
                              timeout=30).stdout
        assert "ExcNodeList=n2" in show, show
        until("the run to finish", (run / "finished").exists, 180, every=0.5,
              detail=lambda: (run / "ledger.jsonl").read_text())
    finally:
        subprocess.run(["scancel", "--name", "slurm-2node"], timeout=30, check=False)
        in_node(cluster, "n2", "umount", str(data))
        shutil.rmtree(data)
    assert (run / "finished").exists(), (run / "ledger.jsonl").read_text()
    hosts = {json.loads(p.read_text())["hostname"] for p in (run / "ranks").glob("rank-*.json")}
    assert hosts == {"n1", "n3"}
