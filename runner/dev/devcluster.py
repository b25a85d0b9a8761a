"""A real multi-node Slurm cluster on one machine, for development and integration tests.

Every node is a `slurmd` in its own network namespace (a veth to a bridge, a private address) and
its own UTS + mount namespace (own hostname, a hosts file listing all nodes, its own cgroup subtree),
so jobs see distinct hostnames and IPs just like on a real cluster, and links can be slowed with tc.
`slurmctld`, `slurmdbd` (with a private MariaDB, so `sacct` works) and `munged` run on the host side.
All state, logs, sockets and configs live under one directory (default /tmp/runner-dev-cluster).

It runs on a developer's machine or a CI host, never on a real cluster, and needs root and the Debian
Slurm packages (`scripts/install-slurm.sh`). Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runner import proc
from runner.errors import ClusterError
from runner.rundir import locked

DEFAULT_ROOT = Path("/tmp/runner-dev-cluster")
ROOT_ENV = "RUNNER_DEV_CLUSTER_DIR"
INSTALL_HINT = "run `sudo scripts/install-slurm.sh`"

CLUSTER_NAME = "devcluster"
PARTITION = "dev"
BRIDGE = "rdcbr0"
SUBNET = "10.77.0"
CONTROLLER_ADDR = f"{SUBNET}.254"
NETNS_PREFIX = "rdc-"
VETH_PREFIX = "rdcv-"
CGROUP_PREFIX = "rdc_"
SLURMCTLD_PORT = 6817
SLURMD_PORT = 6818
SLURMDBD_PORT = 6819
MARIADB_PORT = 6829
DB_USER = "slurm"
DB_PASS = "devcluster"
DB_NAME = "slurm_acct_db"
FREEZER = Path("/sys/fs/cgroup/freezer")

_REQUIRED = {
    "munged": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "slurmdbd": "slurmdbd",
    "sinfo": "slurm-client",
    "scontrol": "slurm-client",
    "mariadbd": "mariadb-server",
    "mariadb-install-db": "mariadb-server",
    "mariadb": "mariadb-client",
    "ip": "iproute2",
    "tc": "iproute2",
    "nsenter": "util-linux",
    "unshare": "util-linux",
}

_HEALTHY_STATES = {"idle", "allocated", "mixed", "completing"}


@dataclass
class Cluster:
    """A running dev cluster: where it lives and how its nodes are named and addressed."""

    root: Path
    conf: Path
    nodes: list[str]
    addresses: dict[str, str]
    netns: dict[str, str]
    veths: dict[str, str] = field(default_factory=dict)
    gpus_per_node: int = 2
    cpus_per_node: int = 4
    controller_addr: str = CONTROLLER_ADDR
    partition: str = PARTITION

    def env(self) -> dict[str, str]:
        """Variables every Slurm client command needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def export_line(self) -> str:
        """A shell line that points Slurm client commands at this cluster."""
        return f"export SLURM_CONF={self.conf}"

    def slurmd_pid(self, node: str) -> int | None:
        """The pid of ``node``'s slurmd (every job step on the node is its descendant), None when not running."""
        return _read_pid(_Paths(self.root).node_pid(node))

    def client_env(self) -> dict[str, str]:
        """os.environ plus env(): what a subprocess running sbatch/sacct should get."""
        return {**os.environ, **self.env()}

    def _to_json(self) -> str:
        data = asdict(self)
        data["root"] = str(self.root)
        data["conf"] = str(self.conf)
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def _from_json(cls, text: str) -> Cluster:
        data = json.loads(text)
        data["root"] = Path(data["root"])
        data["conf"] = Path(data["conf"])
        return cls(**data)


# --------------------------------------------------------------------------------------------
# Commands go through proc.run; only the daemons, which outlive this process, are started here.

TIMEOUT_S = 30  # an ip/tc call or a daemon's start; longer means something is wrong


def _spawn_detached(argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Start a foreground-only daemon so that it is not our child (no zombie, outlives us).

    Not proc.run: the daemon's output goes to its log file for its whole life, not into a pipe we read.
    """
    with open(log, "ab") as out:
        _ = subprocess.run(["setsid", "-f", *argv], stdin=subprocess.DEVNULL, stdout=out,
                           stderr=out, env=env, check=True, close_fds=True)


# --------------------------------------------------------------------------------------------
# Paths


def resolve_root(root: Path | str | None = None) -> Path:
    """The cluster directory: the argument, else $RUNNER_DEV_CLUSTER_DIR, else /tmp/runner-dev-cluster."""
    if root is not None:
        return Path(root).resolve()
    env = os.environ.get(ROOT_ENV)
    return Path(env).resolve() if env else DEFAULT_ROOT


class _Paths:
    def __init__(self, root: Path):
        self.root = root
        self.state = root / "cluster.json"
        self.etc = root / "etc"
        self.conf = self.etc / "slurm.conf"
        self.gres = self.etc / "gres.conf"
        self.cgroup = self.etc / "cgroup.conf"
        self.dbdconf = self.etc / "slurmdbd.conf"
        self.hosts = self.etc / "hosts"
        self.resolv = self.etc / "resolv.conf"
        self.munge = root / "munge"
        self.munge_key = self.munge / "munge.key"
        self.munge_socket = self.munge / "munge.socket.2"
        self.munge_pid = self.munge / "munged.pid"
        self.db = root / "mariadb"
        self.db_data = self.db / "data"
        self.db_socket = self.db / "mariadb.sock"
        self.db_pid = self.db / "mariadb.pid"
        self.db_log = self.db / "mariadb.log"
        self.ctld = root / "ctld"
        self.ctld_state = self.ctld / "state"
        self.ctld_pid = self.ctld / "slurmctld.pid"
        self.ctld_log = self.ctld / "slurmctld.log"
        self.dbd_pid = self.ctld / "slurmdbd.pid"
        self.dbd_log = self.ctld / "slurmdbd.log"
        self.jobcomp = self.ctld / "jobcomp.txt"
        self.nodes = root / "nodes"

    def node(self, name: str) -> Path:
        return self.nodes / name

    def node_pid(self, name: str) -> Path:
        return self.node(name) / "slurmd.pid"


# --------------------------------------------------------------------------------------------
# Checks


def _check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise ClusterError("the dev cluster needs root (network namespaces, daemons); "
                           "run as root, after `sudo scripts/install-slurm.sh`")
    missing = sorted({pkg for cmd, pkg in _REQUIRED.items() if shutil.which(cmd) is None})
    if missing:
        raise ClusterError(f"missing packages for the dev cluster: {' '.join(missing)}; "
                           f"{INSTALL_HINT}")


def _freezer_available() -> bool:
    return (FREEZER / "tasks").exists() and os.access(FREEZER, os.W_OK)


# --------------------------------------------------------------------------------------------
# Processes


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the state follows the parenthesised command name, which may contain spaces
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _read_pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if pid > 0 else None


def _pidfile_alive(path: Path) -> bool:
    pid = _read_pid(path)
    return pid is not None and _pid_alive(pid)


def _kill_pids(pids: list[int], timeout: float = 5.0) -> None:
    """TERM, then KILL what is left after `timeout`."""
    pids = [p for p in pids if p != os.getpid() and _pid_alive(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (timeout if sig == signal.SIGTERM else 2.0)
        while time.monotonic() < deadline:
            pids = [p for p in pids if _pid_alive(p)]
            if not pids:
                return
            time.sleep(0.02)


def _netns_pids(netns: str) -> list[int]:
    """Every process whose network namespace is /run/netns/<netns>."""
    try:
        ino = os.stat(f"/run/netns/{netns}").st_ino
    except FileNotFoundError:
        return []
    want = f"net:[{ino}]"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/net") == want:
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def _wait_for(what: str, pred: Callable[[], Any], timeout: float, log: Path | None = None,
              interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = pred()
        if result:
            return result
        if time.monotonic() > deadline:
            hint = f"; see {log}" if log else ""
            raise ClusterError(f"dev cluster: {what} not ready after {timeout:g}s{hint}")
        time.sleep(interval)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# Configuration


def _render_slurm_conf(p: _Paths, cluster: Cluster, proctrack: str) -> str:
    host = socket.gethostname()
    lines = [
        "# Generated by runner/devcluster.py: a local multi-node development cluster.",
        f"ClusterName={CLUSTER_NAME}",
        f"SlurmctldHost={host}({CONTROLLER_ADDR})",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"SlurmctldPort={SLURMCTLD_PORT}",
        f"SlurmdPort={SLURMD_PORT}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={p.munge_socket},cred_expire=5",
        f"StateSaveLocation={p.ctld_state}",
        f"SlurmdSpoolDir={p.nodes}/%n/spool",
        f"SlurmctldPidFile={p.ctld_pid}",
        f"SlurmdPidFile={p.nodes}/%n/slurmd.pid",
        f"SlurmctldLogFile={p.ctld_log}",
        f"SlurmdLogFile={p.nodes}/%n/slurmd.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        f"ProctrackType={proctrack}",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=127.0.0.1",
        f"AccountingStoragePort={SLURMDBD_PORT}",
        f"AccountingStoragePass={p.munge_socket}",
        "AccountingStorageTRES=gres/gpu",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={p.jobcomp}",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1,bf_interval=1",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        "MpiDefault=none",
        "KillWait=2",
        "MinJobAge=86400",
        "JobRequeue=1",
        "EnforcePartLimits=ALL",
        "SlurmdParameters=config_overrides",
        "SlurmdTimeout=10",
        "SlurmctldTimeout=10",
        "ReturnToService=2",
        "InactiveLimit=0",
        "Waittime=0",
        "MessageTimeout=5",
        "",
    ]
    for node in cluster.nodes:
        lines.append(
            f"NodeName={node} NodeHostname={node} NodeAddr={cluster.addresses[node]} "
            f"CPUs={cluster.cpus_per_node} RealMemory=1024 Gres=gpu:{cluster.gpus_per_node} "
            "State=UNKNOWN")
    lines.append(f"PartitionName={PARTITION} Nodes={','.join(cluster.nodes)} Default=YES "
                 "MaxTime=INFINITE State=UP OverSubscribe=NO")
    return "\n".join(lines) + "\n"


def _render_gres_conf(p: _Paths, cluster: Cluster) -> str:
    lines = ["AutoDetect=off"]
    for node in cluster.nodes:
        dev = p.node(node) / "dev"
        for i in range(cluster.gpus_per_node):
            lines.append(f"NodeName={node} Name=gpu File={dev}/nvidia{i}")
    return "\n".join(lines) + "\n"


def _render_dbd_conf(p: _Paths) -> str:
    return "\n".join([
        "AuthType=auth/munge",
        f"AuthInfo=socket={p.munge_socket}",
        "DbdHost=localhost",
        "DbdAddr=127.0.0.1",
        f"DbdPort={SLURMDBD_PORT}",
        "SlurmUser=root",
        "DebugLevel=info",
        f"LogFile={p.dbd_log}",
        f"PidFile={p.dbd_pid}",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={MARIADB_PORT}",
        f"StorageUser={DB_USER}",
        f"StoragePass={DB_PASS}",
        f"StorageLoc={DB_NAME}",
        "",
    ])


def _render_hosts(cluster: Cluster) -> str:
    lines = ["127.0.0.1 localhost", f"{CONTROLLER_ADDR} {socket.gethostname()} devctl"]
    lines += [f"{cluster.addresses[n]} {n}" for n in cluster.nodes]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    path.chmod(mode)


# --------------------------------------------------------------------------------------------
# Network


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *args] if netns is None else ["ip", "-n", netns, *args]
    return proc.run(argv, timeout=TIMEOUT_S, check=check, error=ClusterError)


def _setup_network(cluster: Cluster) -> None:
    if _ip("link", "show", BRIDGE, check=False).returncode != 0:
        _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "replace", f"{CONTROLLER_ADDR}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for node in cluster.nodes:
        ns, veth = cluster.netns[node], cluster.veths[node]
        if Path(f"/run/netns/{ns}").exists() and \
                _ip("-n", ns, "link", "show", "lo", check=False).returncode != 0:
            _ip("netns", "del", ns, check=False)  # a stale file, not a namespace
            Path(f"/run/netns/{ns}").unlink(missing_ok=True)
        if not Path(f"/run/netns/{ns}").exists():
            _ip("netns", "add", ns)
        if _ip("link", "show", veth, check=False).returncode != 0:
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", BRIDGE, "up")
        _ip("addr", "replace", f"{cluster.addresses[node]}/24", "dev", "eth0", netns=ns)
        _ip("link", "set", "eth0", "up", netns=ns)
        _ip("link", "set", "lo", "up", netns=ns)
        _ip("route", "replace", "default", "via", CONTROLLER_ADDR, netns=ns)


def _teardown_network(netns: list[str], veths: list[str]) -> None:
    for veth in veths:
        _ip("link", "del", veth, check=False)
    for ns in netns:
        _ip("netns", "del", ns, check=False)
    _ip("link", "del", BRIDGE, check=False)


def _leftover_netns() -> list[str]:
    try:
        return sorted(n for n in os.listdir("/run/netns") if n.startswith(NETNS_PREFIX))
    except FileNotFoundError:
        return []


# --------------------------------------------------------------------------------------------
# Daemons


def _start_munge(p: _Paths) -> None:
    p.munge.mkdir(parents=True, exist_ok=True)
    p.munge.chmod(0o755)
    if not p.munge_key.exists():
        p.munge_key.write_bytes(os.urandom(1024))
    p.munge_key.chmod(0o400)
    if _pidfile_alive(p.munge_pid) and p.munge_socket.exists():
        return
    proc.run(["munged", f"--socket={p.munge_socket}", f"--key-file={p.munge_key}",
              f"--pid-file={p.munge_pid}", f"--log-file={p.munge / 'munged.log'}",
              f"--seed-file={p.munge / 'munged.seed'}", "--num-threads=2", "--force"],
             timeout=TIMEOUT_S, error=ClusterError)
    _wait_for("munged", lambda: p.munge_socket.exists(), 5, p.munge / "munged.log")


def _mariadb_argv(p: _Paths) -> list[str]:
    return ["mariadbd", "--no-defaults", "--user=root", f"--datadir={p.db_data}",
            f"--socket={p.db_socket}", f"--pid-file={p.db_pid}", f"--log-error={p.db_log}",
            "--bind-address=127.0.0.1", f"--port={MARIADB_PORT}", "--skip-name-resolve",
            "--skip-log-bin", "--performance-schema=OFF", "--innodb-buffer-pool-size=32M",
            "--innodb-log-file-size=16M", "--innodb-flush-log-at-trx-commit=0",
            "--innodb-doublewrite=0", "--innodb-lock-wait-timeout=900", "--max-connections=50"]


def _sql(p: _Paths, statements: str) -> None:
    proc.run(["mariadb", "--no-defaults", f"--socket={p.db_socket}", "-uroot"], input=statements,
             timeout=TIMEOUT_S, error=ClusterError)


def _start_mariadb(p: _Paths) -> None:
    p.db.mkdir(parents=True, exist_ok=True)
    if not (p.db_data / "mysql").is_dir():
        shutil.rmtree(p.db_data, ignore_errors=True)
        proc.run(["mariadb-install-db", "--no-defaults", f"--datadir={p.db_data}", "--user=root",
                  "--auth-root-authentication-method=socket", "--skip-test-db",
                  "--innodb-log-file-size=16M"], timeout=120, error=ClusterError)
    if not _pidfile_alive(p.db_pid):
        p.db_socket.unlink(missing_ok=True)
        _spawn_detached(_mariadb_argv(p), p.db / "mariadbd.out")


def _prepare_db(p: _Paths) -> None:
    """A fresh accounting database each time, so job ids in sacct match the fresh slurmctld."""
    _wait_for("mariadb", lambda: p.db_socket.exists() and _port_open("127.0.0.1", MARIADB_PORT),
              30, p.db_log)
    _sql(p, f"DROP DATABASE IF EXISTS {DB_NAME};\n"
            f"CREATE USER IF NOT EXISTS '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASS}';\n"
            f"GRANT ALL ON *.* TO '{DB_USER}'@'127.0.0.1';\n")


def _start_slurmdbd(p: _Paths) -> None:
    proc.run(["slurmdbd"], env={**os.environ, "SLURM_CONF": str(p.conf)}, timeout=TIMEOUT_S, error=ClusterError)


def _start_slurmctld(p: _Paths) -> None:
    proc.run(["slurmctld", "-f", str(p.conf), "-c", "-i"], timeout=TIMEOUT_S, error=ClusterError)


def _node_script(p: _Paths, node: str, use_freezer: bool) -> str:
    # No DNS inside a node: the host's nameserver is unreachable from the namespace, so every reverse lookup
    # (gloo/c10d's TCPStore looks up each peer, as ::ffff:10.77.0.x) would wait 10 s for a DNS timeout.
    cmds = ["set -e", f"hostname {node}", f"mount --bind {p.hosts} /etc/hosts",
            f"mount --bind {p.resolv} /etc/resolv.conf"]
    if use_freezer:
        # Each node gets its own freezer subtree: slurm's cgroup paths (slurm/uid_0/job_N/...)
        # would otherwise collide between the nodes of one job.
        sub = FREEZER / f"{CGROUP_PREFIX}{node}"
        cmds.append(f"mkdir -p {sub}")
        cmds.append(f"mount --bind {sub} {FREEZER}")
    cmds.append(f"exec slurmd -f {p.conf} -N {node}")
    return "; ".join(cmds)


def _start_slurmd(p: _Paths, cluster: Cluster, node: str, use_freezer: bool) -> None:
    d = p.node(node)
    (d / "spool").mkdir(parents=True, exist_ok=True)
    proc.run(["nsenter", f"--net=/run/netns/{cluster.netns[node]}", "unshare", "--uts", "--mount",
              "sh", "-c", _node_script(p, node, use_freezer)],
             env={**os.environ, "SLURM_CONF": str(p.conf)}, timeout=TIMEOUT_S, error=ClusterError)


def _make_gpu_devices(p: _Paths, cluster: Cluster) -> None:
    for node in cluster.nodes:
        dev = p.node(node) / "dev"
        dev.mkdir(parents=True, exist_ok=True)
        for i in range(cluster.gpus_per_node):
            path = dev / f"nvidia{i}"
            if not path.exists():
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # like /dev/null


# --------------------------------------------------------------------------------------------
# Queries


def _sinfo_states(cluster: Cluster) -> dict[str, str] | None:
    out = proc.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False,
                   env={**os.environ, "SLURM_CONF": str(cluster.conf)}, timeout=10)
    if out.returncode in (proc.NOT_FOUND, proc.TIMED_OUT):  # no answer is an error, not a "not ready yet"
        raise ClusterError(out.stderr)
    if out.returncode != 0:
        return None
    states: dict[str, str] = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def _all_nodes_ready(cluster: Cluster, nodes: list[str] | None = None) -> bool:
    states = _sinfo_states(cluster)
    if states is None:
        return False
    return all(states.get(n, "").rstrip("*~#!%$@^-") in _HEALTHY_STATES
               for n in (nodes or cluster.nodes))


def _daemons_alive(p: _Paths, cluster: Cluster) -> bool:
    pidfiles = [p.munge_pid, p.db_pid, p.dbd_pid, p.ctld_pid]
    pidfiles += [p.node_pid(n) for n in cluster.nodes]
    return all(_pidfile_alive(f) for f in pidfiles)


_held_locks: dict[Path, int] = {}


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Serialise up/down between processes (re-entrant within one): one cluster per machine."""
    if _held_locks.get(root):
        _held_locks[root] += 1
        try:
            yield
        finally:
            _held_locks[root] -= 1
        return
    with locked(Path(f"{root}.lock")):
        _held_locks[root] = 1
        try:
            yield
        finally:
            _held_locks[root] = 0


def _load(root: Path) -> Cluster | None:
    try:
        return Cluster._from_json((root / "cluster.json").read_text())
    except (FileNotFoundError, ValueError, TypeError, KeyError):
        return None


# --------------------------------------------------------------------------------------------
# API


def running(root: Path | None = None) -> Cluster | None:
    """The cluster under `root` if all its daemons are alive and all its nodes usable, else None."""
    root = resolve_root(root)
    cluster = _load(root)
    if cluster is None or not _daemons_alive(_Paths(root), cluster):
        return None
    return cluster if _all_nodes_ready(cluster) else None


def up(nodes: int = 2, root: Path | None = None, gpus_per_node: int = 2,
       cpus_per_node: int = 4, timeout: float = 60) -> Cluster:
    """Start the cluster (or return the healthy one already running) once every node is idle.

    Each start is fresh: new slurmctld state and a new accounting database, so job ids start at 1
    and `sacct -j ID` never mixes jobs of an earlier cluster.
    """
    _check_prerequisites()
    if not 1 <= nodes <= 200:
        raise ClusterError(f"nodes={nodes} is out of range; use 1..200")
    root = resolve_root(root)
    with _locked(root):
        return _up(root, nodes, gpus_per_node, cpus_per_node, timeout)


def _up(root: Path, nodes: int, gpus_per_node: int, cpus_per_node: int, timeout: float) -> Cluster:
    p = _Paths(root)
    names = [f"n{i}" for i in range(1, nodes + 1)]
    cluster = Cluster(
        root=root, conf=p.conf, nodes=names,
        addresses={n: f"{SUBNET}.{i}" for i, n in enumerate(names, 1)},
        netns={n: f"{NETNS_PREFIX}{n}" for n in names},
        veths={n: f"{VETH_PREFIX}{n}" for n in names},
        gpus_per_node=gpus_per_node, cpus_per_node=cpus_per_node)

    if running(root) == cluster:
        return cluster
    _down(root)  # daemons only: the database files are kept for a faster start
    other = os.environ.get(ROOT_ENV)
    for r in {DEFAULT_ROOT, Path(other).resolve() if other else DEFAULT_ROOT} - {root}:
        if _load(r) is not None:  # one cluster per machine: ports and bridge are fixed
            down(r)

    use_freezer = _freezer_available()
    proctrack = "proctrack/cgroup" if use_freezer else "proctrack/linuxproc"
    for d in (p.etc, p.ctld, p.nodes):
        d.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(p.ctld_state, ignore_errors=True)
    p.ctld_state.mkdir(parents=True)
    for node in names:
        shutil.rmtree(p.node(node) / "spool", ignore_errors=True)
    _write(p.conf, _render_slurm_conf(p, cluster, proctrack))
    _write(p.gres, _render_gres_conf(p, cluster))
    _write(p.cgroup, "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\nConstrainCores=no\n"
                     "ConstrainDevices=no\nConstrainRAMSpace=no\n" if use_freezer
           else "CgroupAutomount=no\n")
    _write(p.dbdconf, _render_dbd_conf(p), 0o600)
    _write(p.hosts, _render_hosts(cluster))
    _write(p.resolv, "# dev cluster nodes: no nameserver; every node name is in /etc/hosts\n")
    _write(p.state, cluster._to_json())
    _make_gpu_devices(p, cluster)

    try:
        _start_munge(p)
        _start_mariadb(p)
        _setup_network(cluster)
        _prepare_db(p)
        _start_slurmdbd(p)
        _wait_for("slurmdbd", lambda: _port_open("127.0.0.1", SLURMDBD_PORT), 30, p.dbd_log)
        _start_slurmctld(p)
        _wait_for("slurmctld", lambda: _port_open(CONTROLLER_ADDR, SLURMCTLD_PORT), 30,
                  p.ctld_log)
        for node in names:
            _start_slurmd(p, cluster, node, use_freezer)
        _wait_for("all nodes idle", lambda: _all_nodes_ready(cluster), timeout, p.ctld_log,
                  interval=0.1)
    except BaseException:
        down(root)
        raise
    return cluster


def down(root: Path | None = None) -> None:
    """Stop every daemon and job process, remove the namespaces, veths and bridge, and everything under the state
    directory (the accounting database is most of it, ~100 MB). Idempotent."""
    root = resolve_root(root)
    with _locked(root):
        _down(root)
        shutil.rmtree(root, ignore_errors=True)


def _down(root: Path) -> None:
    p = _Paths(root)
    cluster = _load(root)
    netns = sorted(set(cluster.netns.values() if cluster else []) | set(_leftover_netns()))
    veths = sorted(set(cluster.veths.values()) if cluster else set())

    # Nodes first (slurmd, slurmstepd, job tasks all live in the node namespaces).
    node_pids = [pid for ns in netns for pid in _netns_pids(ns)]
    node_pids += [pid for f in p.nodes.glob("*/slurmd.pid") if (pid := _read_pid(f))]
    _kill_pids(node_pids, timeout=3)
    # up() starts from empty state, so there is nothing worth a graceful shutdown (~2 s) here
    daemons = [_read_pid(f) for f in (p.ctld_pid, p.dbd_pid)]
    _kill_pids([d for d in daemons if d], timeout=0.5)
    db = _read_pid(p.db_pid)
    if db:
        _kill_pids([db], timeout=15)
    munge = _read_pid(p.munge_pid)
    if munge:
        _kill_pids([munge], timeout=3)
    for f in (p.ctld_pid, p.dbd_pid, p.db_pid, p.munge_pid, *p.nodes.glob("*/slurmd.pid")):
        f.unlink(missing_ok=True)

    if netns or veths or _ip("link", "show", BRIDGE, check=False).returncode == 0:
        _teardown_network(netns, veths)
    _remove_cgroups()
    p.state.unlink(missing_ok=True)


def _remove_cgroups() -> None:
    if not FREEZER.is_dir():
        return
    for top in FREEZER.glob(f"{CGROUP_PREFIX}*"):
        # children first: a cgroup directory can only be removed when it has none
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -t[0].count("/")):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass


def status(root: Path | None = None) -> str:
    """Human-readable nodes and states, or 'not running'."""
    root = resolve_root(root)
    cluster = _load(root)
    if cluster is None:
        return f"dev cluster: not running ({root})"
    p = _Paths(root)
    daemons = {"munged": p.munge_pid, "mariadbd": p.db_pid, "slurmdbd": p.dbd_pid,
               "slurmctld": p.ctld_pid}
    dead = [name for name, f in daemons.items() if not _pidfile_alive(f)]
    states = _sinfo_states(cluster) or {}
    lines = [f"dev cluster at {root} ({len(cluster.nodes)} nodes, "
             f"{cluster.gpus_per_node} fake GPUs each)", f"  {cluster.export_line()}"]
    if dead:
        lines.append(f"  daemons down: {', '.join(dead)}")
    for node in cluster.nodes:
        slurmd = "up" if _pidfile_alive(p.node_pid(node)) else "slurmd dead"
        lines.append(f"  {node:<6} {cluster.addresses[node]:<12} netns={cluster.netns[node]:<10} "
                     f"{states.get(node, 'unknown'):<14} {slurmd}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Fault injection


def _node_check(cluster: Cluster, node: str) -> None:
    if node not in cluster.nodes:
        raise ClusterError(f"no node {node!r} in the dev cluster; nodes: {', '.join(cluster.nodes)}")


def limit_link(cluster: Cluster, node: str, rate_mbit: float) -> None:
    """Cap the node's link to `rate_mbit` in both directions (tbf; this kernel has no netem)."""
    _node_check(cluster, node)
    if rate_mbit <= 0:
        raise ClusterError(f"rate_mbit must be positive, got {rate_mbit}")
    rate = f"{int(rate_mbit * 1000)}kbit"
    # burst must hold at least one timer tick of data; 4 ms worth at the given rate, >= 32 KiB
    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 / 250))
    tbf = ["root", "tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
    proc.run(["tc", "qdisc", "replace", "dev", cluster.veths[node], *tbf], timeout=TIMEOUT_S, error=ClusterError)
    proc.run(["tc", "-n", cluster.netns[node], "qdisc", "replace", "dev", "eth0", *tbf], timeout=TIMEOUT_S,
             error=ClusterError)


def unlimit_link(cluster: Cluster, node: str) -> None:
    """Remove a limit set by limit_link (no error when there is none)."""
    _node_check(cluster, node)
    proc.run(["tc", "qdisc", "del", "dev", cluster.veths[node], "root"], timeout=TIMEOUT_S, check=False)
    proc.run(["tc", "-n", cluster.netns[node], "qdisc", "del", "dev", "eth0", "root"], timeout=TIMEOUT_S,
             check=False)


def kill_node(cluster: Cluster, node: str) -> None:
    """Simulate a node crash: SIGKILL its slurmd, slurmstepds and job processes.

    slurmctld notices after SlurmdTimeout (10 s) and marks the node DOWN; its jobs are requeued
    (JobRequeue=1) or fail, as on a real cluster.
    """
    _node_check(cluster, node)
    pids = _netns_pids(cluster.netns[node])
    pid = _read_pid(_Paths(cluster.root).node_pid(node))
    if pid:
        pids.append(pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_for(f"{node} processes to die", lambda: not any(_pid_alive(x) for x in pids), 5)
    _Paths(cluster.root).node_pid(node).unlink(missing_ok=True)


def revive_node(cluster: Cluster, node: str, timeout: float = 30) -> None:
    """Restart a killed node's slurmd and wait until the node is usable again."""
    _node_check(cluster, node)
    p = _Paths(cluster.root)
    if not _pidfile_alive(p.node_pid(node)):
        _start_slurmd(p, cluster, node, _freezer_available()
                      and "proctrack/cgroup" in p.conf.read_text())
    env = {**os.environ, **cluster.env()}

    def ready() -> bool:
        states = _sinfo_states(cluster) or {}
        state = states.get(node, "")
        if state.startswith(("down", "drain")):
            proc.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env, timeout=TIMEOUT_S,
                     check=False)
            return False
        return state.rstrip("*~#!%$@^-") in _HEALTHY_STATES

    _wait_for(f"{node} to return", ready, timeout, p.node(node) / "slurmd.log", interval=0.2)
