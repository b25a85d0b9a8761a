"""The dev cluster is a real Slurm cluster: multi-node jobs, fake GPUs, accounting, requeue, tc.

Needs root + Slurm (see tests/slurm_fixture.py); what needs neither is in tests/test_devcluster_unit.py and
tests/test_devcluster_local.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runner.dev import busy, devcluster
from tests.waiting import until

pytestmark = pytest.mark.slurm


def _sh(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def _sbatch(script_dir: Path, body: str, *args: str) -> tuple[str, Path]:
    script = script_dir / f"job{len(list(script_dir.glob('job*.sh')))}.sh"
    script.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    out = script_dir / f"{script.stem}.out"
    proc = _sh(["sbatch", "--parsable", f"--output={out}", *args, str(script)])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0], out


def _sacct(job_id: str, fmt: str = "JobID,State,ExitCode") -> str:
    proc = _sh(["sacct", "-X", "-n", "-P", "-j", job_id, f"--format={fmt}"])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _wait_final(job_id: str, timeout: float = 60) -> list[str]:
    """[JobID, State, ExitCode] once sacct shows a final state."""
    def final() -> list[str] | None:
        fields = _sacct(job_id).split("|")
        if len(fields) == 3 and fields[1].split()[0] in (
                "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields
        return None
    return until(f"job {job_id} to finish", final, timeout, every=0.1, detail=lambda: f"sacct: {_sacct(job_id)!r}")



@pytest.mark.slurm
def test_cluster_is_up(slurm_cluster: devcluster.Cluster) -> None:
    c = slurm_cluster
    assert c.nodes == ["n1", "n2"]
    assert os.environ["SLURM_CONF"] == str(c.conf) == c.env()["SLURM_CONF"]
    assert c.export_line() == f"export SLURM_CONF={c.conf}"
    def nodes() -> list[str]:
        return sorted(line for line in _sh(["sinfo", "-h", "-N", "-o", "%N %T %G"]).stdout.split("\n") if line)

    def idle() -> list[str] | None:
        sinfo = nodes()
        return sinfo if sinfo == ["n1 idle gpu:2", "n2 idle gpu:2"] else None
    # an earlier test's job may still be ending (a podman client, a hook)
    sinfo = until("both nodes idle", idle, 60, every=0.5, detail=lambda: f"sinfo: {nodes()}")
    assert sinfo == ["n1 idle gpu:2", "n2 idle gpu:2"]
    text = devcluster.status()
    assert "n1" in text and "n2" in text and "idle" in text
    t0 = time.monotonic()
    assert devcluster.up(nodes=2, gpus_per_node=2) == c  # healthy: returned as it is
    assert time.monotonic() - t0 < 2


@pytest.mark.slurm
def test_multi_node_gpu_job(slurm_cluster: devcluster.Cluster, tmp_path: Path) -> None:
    body = """\
        srun bash -c 'echo "TASK $(hostname) $SLURM_PROCID $SLURM_NODEID $CUDA_VISIBLE_DEVICES \
        $(ip -4 -o addr show | awk "!/ lo /{print \\$4}")"'
        """
    job_id, out = _sbatch(tmp_path, body, "-N2", "--ntasks-per-node=2", "--gres=gpu:2")
    assert _wait_final(job_id)[1:] == ["COMPLETED", "0:0"]
    tasks = [line.split() for line in out.read_text().splitlines() if line.startswith("TASK ")]
    assert len(tasks) == 4, out.read_text()
    hosts = {t[1] for t in tasks}
    assert hosts == {"n1", "n2"}
    assert sorted(int(t[2]) for t in tasks) == [0, 1, 2, 3]
    assert {t[3] for t in tasks} == {"0", "1"}
    assert {t[4] for t in tasks} == {"0,1"}
    ips = {t[1]: t[5].split("/")[0] for t in tasks}
    assert ips == slurm_cluster.addresses
    assert len(set(ips.values())) == 2


@pytest.mark.slurm
def test_exit_code_is_failed(slurm_cluster: devcluster.Cluster, tmp_path: Path) -> None:
    job_id, _ = _sbatch(tmp_path, "exit 3\n")
    assert _wait_final(job_id)[1:] == ["FAILED", "3:0"]


@pytest.mark.slurm
def test_requeue_from_batch_script(slurm_cluster: devcluster.Cluster, tmp_path: Path) -> None:
    body = """\
        echo "RUN restart=${SLURM_RESTART_COUNT:-0} host=$(hostname)"
        if [ "${SLURM_RESTART_COUNT:-0}" -eq 0 ]; then
            scontrol requeue "$SLURM_JOB_ID"
            sleep 60
        fi
        """
    job_id, out = _sbatch(tmp_path, body, "--requeue", "--open-mode=append")
    assert _wait_final(job_id, timeout=90)[1:] == ["COMPLETED", "0:0"]
    runs = [line for line in out.read_text().splitlines() if line.startswith("RUN ")]
    assert [r.split()[1] for r in runs] == ["restart=0", "restart=1"], out.read_text()
    assert "Restarts=1" in _sh(["scontrol", "show", "job", job_id]).stdout


@pytest.mark.slurm
def test_a_busy_partition_takes_released_nodes_before_a_requeued_job(slurm_cluster: devcluster.Cluster,
                                                                      tmp_path: Path) -> None:
    """runner.dev.busy: the benchmarks' stand-in for other users. A job that gives its nodes back (here: requeues
    itself) waits for the fillers that take them, ``hold_s``, where on an empty queue it starts ~6 s later (the
    requeue delay, cred_expire here)."""
    body = """\
        echo "RUN restart=${SLURM_RESTART_COUNT:-0} at=$(date +%s.%N)"
        if [ "${SLURM_RESTART_COUNT:-0}" -eq 0 ]; then
            while [ ! -e "$READY" ]; do sleep 0.1; done
            scontrol requeue "$SLURM_JOB_ID"
            sleep 60
        fi
        """
    ready = tmp_path / "ready"
    os.environ["READY"] = str(ready)
    try:
        job_id, out = _sbatch(tmp_path, body, "--requeue", "--open-mode=append", "--nodes=2", "--exclusive")
    finally:
        del os.environ["READY"]
    until("the job to run", lambda: "restart=0" in (out.read_text() if out.exists() else ""), 30, every=0.1)
    filler = busy.Filler(slurm_cluster, hold_s=15)
    try:
        filler.arm()  # pending behind the running job: they start only where it releases a node
        assert filler.holding() == []
        released = time.time()
        ready.touch()
        until("the fillers to take both nodes", lambda: filler.holding() == ["n1", "n2"], 30, every=0.1)
        assert _wait_final(job_id, timeout=90)[1:] == ["COMPLETED", "0:0"]
        again = [float(line.split("at=")[1]) for line in out.read_text().splitlines() if "restart=1" in line]
        assert again and again[0] - released >= 15, out.read_text()
    finally:
        filler.stop()


_RECEIVER = """
import socket, sys, time
srv = socket.create_server((sys.argv[1], 0))
srv.settimeout(10)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.settimeout(10)
conn.recv(65536)
t0 = time.monotonic(); n = 0
while time.monotonic() - t0 < float(sys.argv[2]):
    data = conn.recv(1 << 20)
    if not data:
        break
    n += len(data)
print(n / (time.monotonic() - t0) * 8 / 1e6, flush=True)
"""

_SENDER = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
chunk = b"x" * 65536
deadline = time.monotonic() + 8
try:
    while time.monotonic() < deadline:
        s.sendall(chunk)
except OSError:
    pass
"""


def _throughput_mbit(cluster: devcluster.Cluster, src: str, dst: str, seconds: float) -> float:
    """Measure TCP throughput src -> dst between two node namespaces, bounded in time."""
    def in_ns(node: str, code: str, *args: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{cluster.netns[node]}", sys.executable, "-c", code,
                *args]

    with subprocess.Popen(in_ns(dst, _RECEIVER, cluster.addresses[dst], str(seconds)),
                          stdout=subprocess.PIPE, text=True) as receiver:
        assert receiver.stdout is not None
        port = receiver.stdout.readline().strip()
        with subprocess.Popen(in_ns(src, _SENDER, cluster.addresses[dst], port),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as sender:
            try:
                rate = float(receiver.stdout.readline())
                receiver.wait(timeout=15)
                sender.wait(timeout=15)  # the receiver closed: sendall fails, the sender ends
            finally:
                for proc in (receiver, sender):
                    if proc.poll() is None:
                        proc.kill()
    return rate


@pytest.mark.slurm
def test_limit_link(slurm_cluster: devcluster.Cluster) -> None:
    c = slurm_cluster
    limit = 40.0
    free = _throughput_mbit(c, "n1", "n2", 0.5)
    devcluster.limit_link(c, "n2", limit)
    try:
        limited_in = _throughput_mbit(c, "n1", "n2", 1.5)
        limited_out = _throughput_mbit(c, "n2", "n1", 1.5)
    finally:
        devcluster.unlimit_link(c, "n2")
    restored = _throughput_mbit(c, "n1", "n2", 0.5)
    assert free > 5 * limit, free
    assert 0.6 * limit < limited_in < 1.25 * limit, limited_in
    assert 0.6 * limit < limited_out < 1.25 * limit, limited_out
    assert restored > 5 * limit, restored


@pytest.mark.slurm
def test_kill_and_revive_node(slurm_cluster: devcluster.Cluster, tmp_path: Path) -> None:
    c = slurm_cluster
    job_id, _ = _sbatch(tmp_path, "srun sleep 300\n", "-w", "n2", "--no-requeue")
    t0 = time.monotonic()  # 30 s for both
    until("the job to start", lambda: _sh(["squeue", "-h", "-j", job_id, "-o", "%T"]).stdout.strip() == "RUNNING",
          30, every=0.1)
    def sleeps_on_n2() -> list[int]:
        pids = devcluster._netns_pids(c.netns["n2"])
        return [p for p in pids if Path(f"/proc/{p}/comm").read_text().strip() == "sleep"]

    # RUNNING comes before srun has started its task
    until("the job's task to start", sleeps_on_n2, 30 - (time.monotonic() - t0), every=0.1)
    try:
        devcluster.kill_node(c, "n2")
        assert not devcluster._netns_pids(c.netns["n2"])  # slurmd, slurmstepd, the job: gone
    finally:
        _sh(["scancel", job_id])
        devcluster.revive_node(c, "n2")
    job2, out = _sbatch(tmp_path, "hostname\n", "-w", "n2")
    assert _wait_final(job2)[1:] == ["COMPLETED", "0:0"]
    assert out.read_text().strip() == "n2"


@pytest.mark.slurm
@pytest.mark.own_session  # it takes the machine's one cluster down: scripts/test.sh runs it in a session of its own
def test_down_removes_everything_under_its_state_directory() -> None:
    """What the README promises: after `runner dev-cluster down` nothing is left under the state directory."""
    from tests.slurm_fixture import _install, _session_lock

    _install()
    root = devcluster.resolve_root()
    with _session_lock(root):  # no other test session is using the cluster while it goes down
        before = devcluster.running()
        devcluster.up(nodes=1, gpus_per_node=1)
        assert sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) > 1 << 20  # the database, logs
        out = subprocess.run([sys.executable, "-m", "runner", "dev-cluster", "down"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert not root.exists(), sorted(str(p) for p in root.rglob("*"))[:10]
        if before is not None:  # leave the machine's cluster as it was
            devcluster.up(nodes=len(before.nodes), gpus_per_node=before.gpus_per_node,
                          cpus_per_node=before.cpus_per_node)
