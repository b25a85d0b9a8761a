"""Preflight: check the nodes and the interconnect inside the allocation, in seconds, before training.

Why: NCCL on the wrong interface trains at a fraction of its speed without an error, and a rendezvous
that cannot complete surfaces only after the process-group timeout. The launcher runs these checks on
every rank before Lightning builds its own process group, names the node and the value that is wrong,
and stops the job (exit 77) before any training step.

How, in phases, never blocking longer than ``preflight.timeout_s`` on the network:
1. every rank checks its own node (GPUs, interface, paths, free space, code and package hashes);
2. rank 0 opens a TCPStore on MASTER_ADDR:MASTER_PORT; the other ranks first probe that port with a plain
   TCP connect (seconds, never a hang), then join and post their results to the store;
3. if nothing failed so far, a short-lived process group (gloo on CPU, nccl on GPU) measures all-reduce
   bandwidth over the whole job and between pairs of nodes, so that a slow node is named;
4. rank 0 writes ``preflight.json`` and ``preflight.txt`` and tells every rank the outcome; on failure the
   alert goes out from rank 0 in a local run, from the batch script's exit hook (host side) under Slurm.
   A rank that cannot reach rank 0 writes its own result under ``logs/preflight/``.

Standard library at import time: ``runner preflight`` (the CLI) imports this module without torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from runner.errors import PreflightError
from runner.job import netenv
from runner.rundir import EXIT_PREFLIGHT, RunDir, atomic_write, read_json

PASS, WARN, FAIL = "pass", "warn", "fail"
_ORDER = {PASS: 0, WARN: 1, FAIL: 2}
ONLY_ENV = "RUNNER_PREFLIGHT_ONLY"  # set by `runner preflight`: stop after the checks, never train
JOB_BUDGET_S = 1.5  # time spent timing the whole-job all-reduce (after one untimed and one sizing op)
PAIR_BUDGET_S = 0.5  # the same, per pair of nodes
SLOW_FACTOR = 0.5  # without a threshold, a node below half the median node bandwidth is called slow
STORE_GRACE_S = 30  # extra time a TCPStore may take to start once its port answers (slow DNS, see run_checks)
SLOW_STORE_S = 2.0  # slower than this is reported (warn)


@dataclass
class Check:
    """One result: what was measured where, against what, and what to do about it."""

    name: str
    node: str
    status: str
    value: str = ""
    threshold: str = ""
    hint: str = ""
    note: str = ""

    def line(self) -> str:
        """One line for alerts and summaries."""
        text = f"{self.name} on {self.node}: {self.value}"
        return text + (f" (expected {self.threshold})" if self.threshold else "")


def worst(statuses: Iterable[str]) -> str:
    return max(statuses, key=lambda s: _ORDER[s], default=PASS)


# ---------------------------------------------------------------------------------------------- bandwidth


def busbw_factor(n: int) -> float:
    """nccl-tests' all-reduce bus-bandwidth factor 2(n-1)/n: what each rank's link carries per byte reduced."""
    return 2.0 * (n - 1) / n if n > 1 else 0.0


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes), as nccl-tests reports it: message size over time."""
    return nbytes / seconds / 1e9


def busbw(algbw_gbps: float, n: int) -> float:
    """Bus bandwidth in GB/s: comparable with the link speed whatever the number of ranks."""
    return algbw_gbps * busbw_factor(n)


def node_bandwidth(pairs: list[dict[str, Any]]) -> dict[str, float]:
    """Each node's bandwidth: the best pair it is part of (a slow node drags down every pair it is in)."""
    out: dict[str, float] = {}
    for p in pairs:
        for node in p["nodes"]:
            out[node] = max(out.get(node, 0.0), p["busbw_gbps"])
    return out


def ring_pairs(n: int) -> list[tuple[int, int]]:
    """Pairs of node indices such that every node is in two pairs (one pair for two nodes)."""
    if n < 2:
        return []
    if n == 2:
        return [(0, 1)]
    return [(i, (i + 1) % n) for i in range(n)]


def evaluate_bandwidth(job: dict[str, Any] | None, pairs: list[dict[str, Any]],
                       min_busbw: float | None) -> list[Check]:
    """Checks for the whole job and for each node; a node is named when its pairs are below the threshold."""
    checks = []
    thr = f">= {min_busbw:g} GB/s" if min_busbw is not None else ""
    hint = ("check NCCL_SOCKET_IFNAME / NCCL_IB_HCA (TCP instead of InfiniBand?) and the node's link; "
            "see logs/nccl/ with network.debug: true")
    if job is not None:
        low = min_busbw is not None and job["busbw_gbps"] < min_busbw
        checks.append(Check("busbw", "job", FAIL if low else PASS, _bw_text(job), thr, hint if low else "",
                            f"all-reduce of {job['size_bytes'] >> 20} MiB over {job['ranks']} ranks"))
    per_node = node_bandwidth(pairs)
    if not per_node:
        return checks
    median = statistics.median(per_node.values())
    two = len(per_node) == 2
    for node, bw in per_node.items():
        mine = [p for p in pairs if node in p["nodes"]]
        detail = ", ".join(f"{'-'.join(p['nodes'])} {p['busbw_gbps']:.3f}" for p in mine)
        note = f"pairs (busbw GB/s): {detail}"
        if two:
            note += "; with 2 nodes a slow link cannot be pinned on one end"
        if min_busbw is not None and bw < min_busbw:
            checks.append(Check("busbw node", node, FAIL, f"{bw:.3f} GB/s", thr, hint, note))
        elif min_busbw is None and bw < SLOW_FACTOR * median:
            checks.append(Check("busbw node", node, WARN, f"{bw:.3f} GB/s",
                                f">= {SLOW_FACTOR:g} x median {median:.3f} GB/s", hint, note))
        else:
            checks.append(Check("busbw node", node, PASS, f"{bw:.3f} GB/s", thr, "", note))
    return checks


def _bw_text(r: Mapping[str, Any]) -> str:
    return f"busbw {r['busbw_gbps']:.3f} GB/s (algbw {r['algbw_gbps']:.3f})"


# ---------------------------------------------------------------------------------------------- tool parsers


def parse_all_reduce_perf(text: str) -> dict[str, Any]:
    """nccl-tests ``all_reduce_perf`` output -> ranks, rows (size, algbw, busbw, wrong), average busbw.

    Rows give out-of-place then in-place columns; the out-of-place ones are kept (nccl-tests' own gate,
    NCCL_TESTS_MIN_BW, also looks at the large sizes). ``#wrong`` is "N/A" when validation is off.
    """
    rows = []
    ranks = 0
    avg = None
    for line in text.splitlines():
        if re.match(r"#\s+Rank\s+\d+\s", line):
            ranks += 1
            continue
        m = re.match(r"#\s*Avg bus bandwidth\s*:\s*([\d.]+)", line)
        if m:
            avg = float(m.group(1))
            continue
        parts = line.split()
        if len(parts) >= 9 and parts[0].isdigit() and parts[1].isdigit():
            wrong = parts[8]
            rows.append({"size_bytes": int(parts[0]), "time_us": float(parts[5]), "algbw_gbps": float(parts[6]),
                         "busbw_gbps": float(parts[7]), "wrong": int(wrong) if wrong.isdigit() else None})
    if not rows:
        raise PreflightError("all_reduce_perf: found no result rows in its output; expected nccl-tests' table. "
                             "hint: run it by hand to see its error")
    return {"ranks": ranks, "rows": rows, "avg_busbw_gbps": avg, "largest": rows[-1]}


def parse_ib_write_bw(text: str) -> dict[str, Any]:
    """perftest ``ib_write_bw`` output -> device, link type, message size, peak and average bandwidth in Gb/s.

    perftest reports MB/sec unless run with ``--report_gbits``; both are converted to Gb/s (MB = 2^20 bytes).
    """
    dev = re.search(r"Device\s*:\s*(\S+)", text)
    link = re.search(r"Link type\s*:\s*(\S+)", text)
    header = re.search(r"#bytes\s+#iterations\s+BW peak\[(\w+)/sec\]\s+BW average\[(\w+)/sec\]", text)
    if not header:
        raise PreflightError("ib_write_bw: found no result table; expected perftest's '#bytes #iterations' "
                             "header. hint: run it by hand to see its error")
    unit = header.group(1)
    rows = re.findall(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", text[header.end():], re.M)
    if not rows:
        raise PreflightError("ib_write_bw: found the header but no result row. hint: run it by hand")
    size, iters, peak, avg, rate = rows[-1]
    scale = 1.0 if unit == "Gb" else 8 * 2**20 / 1e9
    return {"device": dev.group(1) if dev else None, "link_type": link.group(1) if link else None,
            "size_bytes": int(size), "iterations": int(iters), "peak_gbits": float(peak) * scale,
            "avg_gbits": float(avg) * scale, "msg_rate_mpps": float(rate)}


# ---------------------------------------------------------------------------------------------- node checks


_SIOCGIFADDR, _SIOCGIFFLAGS, _IFF_UP = 0x8915, 0x8913, 0x1


def interfaces() -> dict[str, dict[str, Any]]:
    """This node's interfaces: name -> IPv4 address (or None) and whether it is up (ioctl, no iproute2)."""
    import fcntl
    import struct

    out: dict[str, dict[str, Any]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                addr: str | None = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
            except OSError:
                addr = None
            try:
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)[16:18])[0]
            except OSError:
                flags = 0
            out[name] = {"addr": addr, "up": bool(flags & _IFF_UP)}
    return out


def _matches(spec: str, names: Iterable[str]) -> list[str] | None:
    """Interfaces selected by an NCCL-style spec (``eth`` prefix, ``=eth0`` exact, lists); None for ``^...``."""
    if spec.startswith("^"):
        return None
    exact = spec.startswith("=")
    items = [i for i in spec.lstrip("=").split(",") if i]
    return [n for n in names if any(n == i or (not exact and n.startswith(i)) for i in items)]


def check_interface(spec: str | None, node: str, ifaces: Mapping[str, Mapping[str, Any]],
                    route_ifname: str | None, master: str) -> Check:
    """The interface the job will use exists here, is up, has an address, and (warn) routes to MASTER_ADDR."""
    listing = ", ".join(f"{n} ({i['addr'] or 'no IPv4'})" for n, i in sorted(ifaces.items()))
    if not spec:
        return Check("interface", node, WARN, "none chosen", "an interface", "set network.ifname",
                     f"MASTER_ADDR {master} did not resolve to a route; interfaces here: {listing}")
    chosen = _matches(spec, ifaces)
    if chosen is None:
        return Check("interface", node, PASS, spec, "", "", f"exclusion list, not checked; here: {listing}")
    usable = [n for n in chosen if ifaces[n]["up"] and ifaces[n]["addr"]]
    if not usable:
        found = "not up or without an address" if chosen else "not found"
        better = f"set network.ifname: {route_ifname}" if route_ifname else "set network.ifname to one of them"
        return Check("interface", node, FAIL, f"{spec} {found}", "an existing interface that is up",
                     f"interfaces here: {listing}; {better} or leave it null to detect it", "")
    value = ", ".join(f"{n} {ifaces[n]['addr']}" for n in usable)
    if route_ifname and route_ifname not in usable:
        return Check("interface", node, WARN, value, f"the route to MASTER_ADDR ({route_ifname})",
                     "fine when this interface's subnet joins all nodes (e.g. IPoIB); else set network.ifname",
                     f"MASTER_ADDR {master} is reached through {route_ifname}")
    return Check("interface", node, PASS, value, "exists, up, routes to MASTER_ADDR")


def check_gpus(accelerator: str, devices: int, visible: int | None, node: str,
               cuda_visible: str | None) -> Check:
    """GPUs this node's ranks can see = trainer.devices (a CPU run passes with a note)."""
    if accelerator == "cpu":
        return Check("gpus", node, PASS, "cpu run", "", "", "CPU run: no GPUs needed"
                     + (f" (CUDA_VISIBLE_DEVICES={cuda_visible})" if cuda_visible else ""))
    seen = visible or 0
    ok = seen >= devices
    return Check("gpus", node, PASS if ok else FAIL, f"{seen} visible", f">= {devices} (trainer.devices)",
                 "" if ok else "check --gres=gpu:N / slurm.gpus_per_node, the driver (nvidia-smi) and --nv",
                 f"CUDA_VISIBLE_DEVICES={cuda_visible}" if cuda_visible is not None else "")


def check_path(path: str, node: str, write: bool) -> Check:
    """A dataset path readable (or the checkpoint folder writable) on this node."""
    p = Path(path)
    need = "writable" if write else "readable"
    name = "checkpoint dir" if write else "path"
    if not p.exists():
        return Check(name, node, FAIL, f"{path} missing", f"exists, {need}",
                     "stage it on every node or fix preflight.paths (node-local disks differ)")
    try:
        if write:
            with tempfile.NamedTemporaryFile(dir=p, prefix=".preflight-"):
                pass
        elif p.is_dir():
            with os.scandir(p) as it:
                next(it, None)
        else:
            with open(p, "rb") as f:
                f.read(1)
    except OSError as e:
        return Check(name, node, FAIL, f"{path}: {e.strerror}", f"exists, {need}", "check permissions and mounts")
    return Check(name, node, PASS, path, f"exists, {need}")


def check_free_space(path: str, node: str, min_free_gb: float) -> Check:
    try:
        free = shutil.disk_usage(path).free / 1e9
    except OSError as e:
        return Check("free space", node, FAIL, f"{path}: {e.strerror}", f">= {min_free_gb:g} GB")
    ok = free >= min_free_gb
    return Check("free space", node, PASS if ok else FAIL, f"{free:.1f} GB free", f">= {min_free_gb:g} GB",
                 "" if ok else f"free space on {path} or move run_root; checkpoints will not fit")


def code_files(cfg: Mapping[str, Any]) -> list[Path]:
    """The runner package and the modules of the model and data targets: the code every node must share."""
    here = Path(__file__).resolve().parent
    files = sorted(here.glob("*.py"))
    for section in ("model", "data"):
        target = str((cfg.get(section) or {}).get("_target_", ""))
        module = target.rpartition(".")[0]
        try:
            spec = importlib.util.find_spec(module) if module else None
        except (ImportError, ValueError):
            spec = None
        if spec and spec.origin and spec.origin.endswith(".py"):
            files.append(Path(spec.origin))
    return sorted(set(files))


def versions(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Hashes of the code and the installed packages, plus the versions people ask about first."""
    h = hashlib.sha256()
    for f in code_files(cfg):
        h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    packages = {}
    for d in importlib.metadata.distributions():
        name = d.metadata["Name"]
        if name:
            packages[name.lower()] = d.version
    return {"code": h.hexdigest()[:16], "python": sys.version.split()[0], "packages": packages,
            "packages_hash": hashlib.sha256(json.dumps(packages, sort_keys=True).encode()).hexdigest()[:16]}


def compare_versions(by_node: Mapping[str, Mapping[str, Any]]) -> list[Check]:
    """Code and packages must be the same on every node; the nodes outside the majority are named."""
    nodes = list(by_node)
    if not nodes:
        return []

    def odd(key: Callable[[Mapping[str, Any]], Any]) -> tuple[list[str], Any]:
        groups: dict[str, list[str]] = {}
        for n in nodes:
            groups.setdefault(json.dumps(key(by_node[n]), sort_keys=True), []).append(n)
        ref = max(groups.values(), key=len)  # ties: the group seen first, i.e. the one with node 0
        return [n for n in nodes if n not in ref], key(by_node[ref[0]])

    checks = []
    bad, ref = odd(lambda v: v["code"])
    checks.append(Check("code", ", ".join(bad) or "all", FAIL if bad else PASS,
                        ", ".join(f"{n}: {by_node[n]['code']}" for n in bad) or ref,
                        f"same on every node (majority: {ref})" if bad else "same on every node",
                        "different code on a node: sync the checkout or rebuild/pull the image" if bad else ""))
    bad, ref = odd(lambda v: (v["python"], v["packages"]))
    diffs = []
    for n in bad:
        mine, theirs = by_node[n]["packages"], ref[1]
        names = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        diffs += [f"{n}: {k} {mine.get(k, 'missing')} (others {theirs.get(k, 'missing')})" for k in names[:5]]
        if by_node[n]["python"] != ref[0]:
            diffs.append(f"{n}: python {by_node[n]['python']} (others {ref[0]})")
    checks.append(Check("packages", ", ".join(bad) or "all", FAIL if bad else PASS,
                        "; ".join(diffs) or f"python {ref[0]}, {len(ref[1])} packages identical",
                        "same on every node", "install the same environment everywhere (use the image)" if bad else ""))
    return checks


# ---------------------------------------------------------------------------------------------- reachability


def probe_tcp(host: str, port: int, timeout_s: float) -> tuple[bool, str, float]:
    """Connect to host:port, retrying while rank 0 is not listening yet; never longer than timeout_s.

    Returns (reached, what happened, seconds). Refused means nothing listens (yet): retried quickly. A
    connect timeout means packets are dropped (a firewall, a wrong address): retried until the deadline.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False, last, time.monotonic() - t0
        try:
            with socket.create_connection((host, port), timeout=min(2.0, left)):
                return True, "connected", time.monotonic() - t0
        except socket.gaierror as e:
            return False, f"cannot resolve {host}: {e.strerror}", time.monotonic() - t0
        except ConnectionRefusedError:
            last = "connection refused (nothing listening: wrong MASTER_PORT, or rank 0 not started)"
        except TimeoutError:
            last = "connection timed out (packets dropped: a firewall or a wrong address?)"
        except OSError as e:
            last = f"{e.strerror or e}"
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def _is_local_address(host: str, ifaces: Mapping[str, Mapping[str, Any]]) -> bool:
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return False
    return ip.startswith("127.") or any(i["addr"] == ip for i in ifaces.values())


# ---------------------------------------------------------------------------------------------- the report


def report_status(checks: list[Check], fail_on_warn: bool) -> str:
    status = worst(c.status for c in checks)
    return FAIL if status == WARN and fail_on_warn else status


def summary(checks: list[Check], status: str) -> str:
    bad = [c for c in checks if c.status == FAIL] or [c for c in checks if c.status == WARN]
    if not bad:
        return f"preflight {status}: {len(checks)} checks passed"
    more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
    return f"preflight {status}: " + "; ".join(c.line() for c in bad[:3]) + more


def _collapse(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row for a check that passed on several nodes (the json keeps every node); problems stay per node."""
    out: list[dict[str, Any]] = []
    groups: dict[str, dict[str, Any]] = {}
    for c in checks:
        key = f"{c['name']}\0{(c['value'].split() or [''])[0]}"  # same check, same interface / path / tool
        if c["status"] != PASS or c["name"] in ("busbw node",):
            out.append(dict(c))
        elif key not in groups:
            groups[key] = dict(c, nodes=[c["node"]])
            out.append(groups[key])
        else:
            g = groups[key]
            g["nodes"].append(c["node"])
            if c["value"] != g["value"] and not g["value"].endswith(" (varies)"):
                g["value"] += " (varies)"
            if c.get("note") != g.get("note"):
                g["note"] = ""
    for g in groups.values():
        n = g.pop("nodes")
        g["node"] = n[0] if len(n) == 1 else ",".join(n) if len(n) <= 4 else f"{len(n)} nodes"
    return out


def table(report: Mapping[str, Any]) -> str:
    """The report as a plain-text table (preflight.txt, `runner preflight`, the rank-0 log)."""
    head = (f"preflight {report['status'].upper()} in {report.get('duration_s', 0):.1f} s: "
            f"{len(report.get('nodes', []))} nodes, {report.get('world_size')} ranks, "
            f"{report.get('backend') or 'no'} probe, master {report.get('master')}")
    cols = ("name", "node", "status", "value", "threshold", "hint")
    checks = _collapse(report["checks"])
    rows = [[str(c.get(k, "")) for k in cols] for c in checks]
    widths = [min(48, max([len(h)] + [len(r[i]) for r in rows])) for i, h in enumerate(cols)]
    lines = [head, "  ".join(h.upper().ljust(w) for h, w in zip(cols, widths, strict=True)).rstrip()]
    for r, c in zip(rows, checks, strict=True):
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
        if c.get("note"):
            lines.append(f"    note: {c['note']}")
    lines.append(report.get("summary", ""))
    return "\n".join(lines) + "\n"


def rank_file(rd: RunDir, rank: int) -> Path:
    """Where a rank that could not reach rank 0 leaves its own result (the run directory is shared)."""
    return rd.logs / "preflight" / f"rank-{rank:05d}.json"


# ---------------------------------------------------------------------------------------------- inside the job


@dataclass
class _Job:
    rd: RunDir
    cfg: dict[str, Any]
    rank: int
    local: int
    node: int
    world: int
    ne: netenv.NetEnv
    host: str = field(default_factory=socket.gethostname)
    t0: float = field(default_factory=time.monotonic)

    @property
    def pf(self) -> dict[str, Any]:
        return dict(self.cfg["preflight"])

    @property
    def master(self) -> tuple[str, int]:
        # Its own port, next to MASTER_PORT: ranks that finish preflight early must never reach a preflight
        # store that is closing when they rendezvous for Lightning on MASTER_PORT ("Failed to recv").
        master_port = int(os.environ.get("MASTER_PORT", "29500"))
        return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("RUNNER_PREFLIGHT_PORT",
                                                                               master_port + 1))


def _local_facts(job: _Job) -> dict[str, Any]:
    """What this rank checks on its own node; only the first rank of a node checks node-wide things."""
    facts: dict[str, Any] = {"rank": job.rank, "host": job.host, "node": job.node, "local": job.local,
                             "checks": [], "versions": None}
    if job.local != 0:
        return facts
    import torch

    cfg, pf, host = job.cfg, job.pf, job.host
    ifaces = interfaces()
    from runner.job.ifname import detect_ifname

    master = job.master[0]
    checks = [check_gpus(cfg["trainer"]["accelerator"], int(cfg["trainer"]["devices"]),
                         torch.cuda.device_count() if torch.cuda.is_available() else 0, host,
                         os.environ.get("CUDA_VISIBLE_DEVICES")),
              check_interface(job.ne.ifname, host, ifaces, detect_ifname(master), master)]
    if job.rank == 0 and not _is_local_address(master, ifaces):
        checks.append(Check("master addr", host, FAIL, f"MASTER_ADDR {master} is not this node",
                            "rank 0's node", "MASTER_ADDR must be the node of rank 0 (first node of the job)"))
    checks += [check_path(str(p), host, write=False) for p in pf.get("paths") or []]
    checks.append(check_path(str(job.rd.checkpoints), host, write=True))
    checks.append(check_free_space(str(job.rd.checkpoints), host, float(pf["min_free_gb"])))
    facts["checks"] = [asdict(c) for c in checks]
    facts["versions"] = versions(cfg)
    facts["ifname"] = job.ne.ifname
    return facts


def _measure(torch: Any, dist: Any, nbytes: int, group: Any, n: int, device: Any, budget_s: float) -> dict[str, Any]:
    """Time all-reduces of nbytes in `group`: one to connect, one to size the loop, then the timed loop."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

    def timed(iters: int) -> float:
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = torch.tensor([(time.perf_counter() - t) / iters], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)  # everyone agrees on the slowest rank's time
        return float(dt.item())

    timed(1)
    iters = max(1, min(20, int(budget_s / max(timed(1), 1e-6))))
    sec = timed(iters)
    alg = algbw(nbytes, sec)
    return {"size_bytes": nbytes, "ranks": n, "iters": iters, "time_s": sec, "algbw_gbps": alg,
            "busbw_gbps": busbw(alg, n)}


def _probe(job: _Job, store: Any, leaders: list[int], hosts: list[str]) -> tuple[str, dict[str, Any]]:
    """Bandwidth over the whole job and between ring pairs of nodes; returns (backend, results on rank 0)."""
    import torch
    import torch.distributed as dist

    gpu = job.cfg["trainer"]["accelerator"] != "cpu" and torch.cuda.is_available()
    backend = "nccl" if gpu else "gloo"
    device = torch.device("cuda", job.local) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=2 * job.pf["timeout_s"])
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=job.rank, world_size=job.world,
                            timeout=timeout)
    try:
        nbytes = int(job.pf["probe_mib"]) << 20
        out: dict[str, Any] = {"job": _measure(torch, dist, nbytes, None, job.world, device, JOB_BUDGET_S),
                               "pairs": []}
        pairs = ring_pairs(len(leaders))
        groups = [dist.new_group([leaders[a], leaders[b]]) for a, b in pairs]
        for (a, b), group in zip(pairs, groups, strict=True):
            if job.rank in (leaders[a], leaders[b]):
                res = _measure(torch, dist, nbytes, group, 2, device, PAIR_BUDGET_S)
                out["pairs"].append({**res, "nodes": [hosts[a], hosts[b]]})
            dist.barrier()
        if job.rank != 0 and out["pairs"]:
            store.set(f"pairs/{job.rank}", json.dumps(out["pairs"]))
        dist.barrier()
        if job.rank == 0:
            seen = {tuple(p["nodes"]) for p in out["pairs"]}
            for r in leaders[1:]:
                for p in json.loads(store.get(f"pairs/{r}")) if store.check([f"pairs/{r}"]) else []:
                    if tuple(p["nodes"]) not in seen:
                        seen.add(tuple(p["nodes"]))
                        out["pairs"].append(p)
        return backend, out
    finally:
        dist.destroy_process_group()


def _tools(job: _Job, store: Any, leaders: list[int], hosts: list[str]) -> list[dict[str, Any]]:
    """nccl-tests and perftest, when the image has them: intra-node all_reduce_perf, ib_write_bw between pairs."""
    checks: list[Check] = []
    if job.local != 0:
        return []
    import torch

    mib = int(job.pf["probe_mib"])
    limit = 5 * job.pf["timeout_s"]
    if job.cfg["trainer"]["accelerator"] != "cpu" and torch.cuda.is_available() and shutil.which("all_reduce_perf"):
        argv = ["all_reduce_perf", "-b", f"{mib}M", "-e", f"{mib}M", "-g", str(torch.cuda.device_count()),
                "-w", "2", "-n", "10"]
        checks.append(_run_tool("nccl-tests", job.host, argv, limit, _nccl_tests_check))
    devices = sorted(p.name for p in Path("/sys/class/infiniband").glob("*"))
    if shutil.which("ib_write_bw") and devices and len(leaders) >= 2:
        hca = re.split(r"[,:]", str(job.cfg["network"].get("ib_hca") or devices[0]).lstrip("=^"))[0]
        me = leaders.index(job.rank)
        port = str(job.master[1] + 1)
        for i, (a, b) in enumerate(ring_pairs(len(leaders))):
            base = ["ib_write_bw", "-d", hca, "-p", port, "-F", "--report_gbits", "-D", "1"]
            if me == b:  # server: listens until the client of this pair has run
                server = subprocess.Popen(base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                store.set(f"ib/ready/{i}", "1")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.communicate(timeout=limit)
                server.kill()
                server.wait()
            elif me == a:
                store.wait([f"ib/ready/{i}"], timedelta(seconds=limit))
                time.sleep(0.5)
                checks.append(_run_tool(f"ib_write_bw {hosts[a]}->{hosts[b]}", job.host, [*base, hosts[b]], limit,
                                        _ib_check))
    return [asdict(c) for c in checks]


def _run_tool(name: str, host: str, argv: list[str], limit: float, judge: Callable[[str, str], Check]) -> Check:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return Check(name, host, FAIL, f"no result within {limit:g} s", "", "run it by hand: " + " ".join(argv))
    if out.returncode != 0:
        err = (out.stderr or out.stdout).strip().splitlines()
        return Check(name, host, FAIL, f"exit {out.returncode}: {err[-1] if err else ''}", "exit 0",
                     "run it by hand: " + " ".join(argv))
    try:
        return judge(out.stdout, host)
    except PreflightError as e:
        return Check(name, host, FAIL, str(e), "")


def _nccl_tests_check(text: str, host: str) -> Check:
    r = parse_all_reduce_perf(text)
    big = r["largest"]
    bad = bool(big["wrong"])
    return Check("nccl-tests", host, FAIL if bad else PASS, f"busbw {big['busbw_gbps']:.1f} GB/s at "
                 f"{big['size_bytes'] >> 20} MiB, {r['ranks']} GPUs", "#wrong = 0",
                 "results were wrong: check the GPUs and NVLink (nvidia-smi topo -m)" if bad else "",
                 "all_reduce_perf inside the node")


def _ib_check(text: str, host: str) -> Check:
    r = parse_ib_write_bw(text)
    return Check("ib_write_bw", host, PASS, f"{r['avg_gbits']:.1f} Gb/s average on {r['device']}",
                 "", "", f"link {r['link_type']}, {r['size_bytes']} B messages")


def _collect(job: _Job, store: Any) -> tuple[list[dict[str, Any]], list[int]]:
    """Rank 0: every rank's facts from the store, or from its own file when it could not reach us."""
    deadline = time.monotonic() + job.pf["timeout_s"] + 3  # the common case: an unreachable rank wrote its file
    got: dict[int, dict[str, Any]] = {}
    while True:
        for r in range(job.world):
            if r not in got and store.check([f"local/{r}"]):
                got[r] = json.loads(store.get(f"local/{r}"))
        missing = [r for r in range(job.world) if r not in got]
        if not missing or (time.monotonic() > deadline and all(rank_file(job.rd, r).exists() for r in missing)):
            break
        if time.monotonic() > deadline + STORE_GRACE_S:  # a rank neither reported nor wrote: it never started
            break
        time.sleep(0.05)
    facts = [got[r] for r in sorted(got)]
    for r in missing:
        data = read_json(rank_file(job.rd, r))
        facts.append(data if data else {"rank": r, "host": f"rank {r}", "checks": [asdict(Check(
            "reach master", f"rank {r}", FAIL, f"did not report within {job.pf['timeout_s']} s", "reports",
            f"see logs/rank-{r:05d}.log; the rank may not have started"))], "versions": None})
    return facts, missing


def _evaluate_local(job: _Job, facts: list[dict[str, Any]]) -> list[Check]:
    checks = [Check(**c) for f in facts for c in f["checks"]]
    by_node = {f["host"]: f["versions"] for f in facts if f.get("versions")}
    checks += compare_versions(by_node)
    slow = max((f for f in facts if "store_s" in f), key=lambda f: f["store_s"], default=None)
    if slow is not None:
        bad = slow["store_s"] > SLOW_STORE_S
        checks.append(Check("rendezvous", slow["host"] if bad else "all", WARN if bad else PASS,
                            f"TCPStore up in {slow['store_s']:.1f} s", f"< {SLOW_STORE_S:g} s",
                            "slow name resolution (c10d looks up peer names): fix the DNS server in "
                            "/etc/resolv.conf or list the nodes in /etc/hosts; every job pays this" if bad else "",
                            f"slowest rank {slow['rank']}"))
    return checks


def _finish(job: _Job, checks: list[Check], extra: dict[str, Any]) -> str:
    """Rank 0: status, report files, ledger, alert on failure."""
    status = report_status(checks, bool(job.pf["fail_on_warn"]))
    text = summary(checks, status)
    addr, port = job.master
    report = {"status": status, "summary": text, "time": time.time(), "duration_s": time.monotonic() - job.t0,
              "world_size": job.world, "master": f"{addr}:{port}", "checks": [asdict(c) for c in checks],
              "thresholds": {k: job.pf[k] for k in ("min_busbw_gbps", "probe_mib", "timeout_s", "min_free_gb")},
              **extra}
    atomic_write(job.rd.root / "preflight.txt", table(report))
    print(table(report), end="", flush=True)
    job.rd.record("preflight", status=status, duration_s=round(report["duration_s"], 2), summary=text)
    if status == FAIL and "SLURM_JOB_ID" not in os.environ:  # under Slurm the batch script's exit hook alerts
        from runner import alerts

        alerts.notify(job.rd.root, job.cfg.get("alerts"), "preflight_failed", exit_code=EXIT_PREFLIGHT, cause=text,
                      extra={"report": "preflight.txt"})
    atomic_write(job.rd.preflight, json.dumps(report, indent=2) + "\n")
    return status


def _unreachable(job: _Job, facts: dict[str, Any], what: str, seconds: float) -> str:
    """A rank that cannot reach rank 0: leave its result where rank 0 reads it, wait for the report, fail."""
    addr, port = job.master
    facts["checks"].append(asdict(Check(
        "reach master", job.host, FAIL, f"{addr}:{port} not reachable from {job.host} after {seconds:.1f} s: {what}",
        f"connect within {job.pf['timeout_s']} s",
        "a firewall between nodes, a wrong MASTER_ADDR/MASTER_PORT, or rank 0 failed to start (see its log)")))
    with contextlib.suppress(OSError):  # a run directory that is not shared: rank 0 still names the rank
        atomic_write(rank_file(job.rd, job.rank), json.dumps(facts) + "\n")
    print(f"runner: preflight: {facts['checks'][-1]['value']}", flush=True)
    deadline = time.monotonic() + job.pf["timeout_s"] + 30  # rank 0 may still be sending the alert
    while not job.rd.preflight.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return FAIL


def run_checks(job: _Job) -> str:
    """Every rank: the whole preflight; returns the overall status (the same on every rank that got it)."""
    import torch.distributed as dist

    pf = job.pf
    facts = _local_facts(job)
    addr, port = job.master
    if job.world == 1:
        checks = [Check(**c) for c in facts["checks"]]
        checks += compare_versions({job.host: facts["versions"]})
        return _finish(job, checks, {"nodes": [job.host], "backend": None,
                                     "bandwidth": {"note": "one rank: nothing to measure"}})
    # The port is known to answer (or is our own) when a store is built, so a slow store is name resolution:
    # c10d looks up the peers' names, and a DNS server that does not answer costs 10-20 s on every job.
    timeout = timedelta(seconds=pf["timeout_s"] + STORE_GRACE_S)
    t_store = time.monotonic()
    if job.rank == 0:
        try:
            store = dist.TCPStore(addr, port, job.world, True, timeout, wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            checks = [Check(**c) for c in facts["checks"]] + [Check(
                "listen", job.host, FAIL, f"cannot listen on {addr}:{port}: {str(e).splitlines()[0]}", "",
                "another process holds MASTER_PORT on this node")]
            return _finish(job, checks, {"nodes": [job.host], "backend": None})
    else:
        ok, what, seconds = probe_tcp(addr, port, pf["timeout_s"])
        if not ok:
            return _unreachable(job, facts, what, seconds)
        facts["reach_s"] = seconds
        store = dist.TCPStore(addr, port, job.world, False, timeout)
    facts["store_s"] = time.monotonic() - t_store
    store.set(f"local/{job.rank}", json.dumps(facts))
    wait = timedelta(seconds=2 * (pf["timeout_s"] + STORE_GRACE_S) + 10)
    if job.rank == 0:
        all_facts, missing = _collect(job, store)
        checks = _evaluate_local(job, all_facts)
        leader_facts = sorted((f for f in all_facts if f.get("local") == 0), key=lambda f: f["node"])
        leaders, hosts = [f["rank"] for f in leader_facts], [f["host"] for f in leader_facts]
        go = not missing and worst(c.status for c in checks) != FAIL
        store.set("decision", json.dumps({"go": go, "leaders": leaders, "hosts": hosts}))
    else:
        store.wait(["decision"], wait)
        d = json.loads(store.get("decision"))
        go, leaders, hosts = d["go"], d["leaders"], d["hosts"]
    extra: dict[str, Any] = {"nodes": hosts, "backend": None}
    if go:
        try:
            backend, bw = _probe(job, store, leaders, hosts)
            extra.update(backend=backend, bandwidth=bw)
            tools = _tools(job, store, leaders, hosts)
        except RuntimeError as e:  # a timeout or a connect error inside gloo/nccl: the data plane is broken
            bw, tools = {}, [asdict(Check("probe", job.host, FAIL, str(e).splitlines()[0][:300], "completes",
                                          "the data plane between nodes is broken: check the interface and "
                                          "firewalls for the ports gloo/NCCL open"))]
        store.set(f"tools/{job.rank}", json.dumps(tools))
    tools_s = 5 * pf["timeout_s"] + 10  # nccl-tests and ib_write_bw, when present, get this long
    if job.rank != 0:
        store.wait(["final"], timedelta(seconds=tools_s + 30))  # + rank 0 sending the alert
        status = str(store.get("final").decode())
        store.set(f"bye/{job.rank}", "1")
        return status
    if go:
        deadline = time.monotonic() + tools_s
        for r in range(job.world):
            while not store.check([f"tools/{r}"]) and time.monotonic() < deadline:
                time.sleep(0.05)
            checks += [Check(**c) for c in json.loads(store.get(f"tools/{r}"))] if store.check([f"tools/{r}"]) else []
        bw = extra.get("bandwidth") or {}
        checks += evaluate_bandwidth(bw.get("job"), bw.get("pairs", []), pf["min_busbw_gbps"])
    status = _finish(job, checks, extra)
    store.set("final", status)
    with contextlib.suppress(RuntimeError):  # let the others disconnect before the server goes away
        store.wait([f"bye/{r}" for r in range(1, job.world)], timedelta(seconds=5))
    return status


def in_job(rd: RunDir, cfg: dict[str, Any], rank: int, local: int, node: int, world: int) -> int | None:
    """The launcher's hook: set the network environment, run the checks; an exit code, or None to train."""
    ne = netenv.plan(cfg, rd.logs, os.environ)
    netenv.apply(ne)
    for line in ne.report():
        print(line, flush=True)
    if rank == 0:
        netenv.record(ne, rd.env_file)
    only = os.environ.get(ONLY_ENV) == "1"
    if not cfg["preflight"]["enabled"] and not only:
        return None
    job = _Job(rd, cfg, rank, local, node, world, ne)
    status = run_checks(job)
    print(f"runner: preflight {status} ({time.monotonic() - job.t0:.1f} s)", flush=True)
    if status == FAIL:
        return EXIT_PREFLIGHT
    return 0 if only else None


# ---------------------------------------------------------------------------------------------- the CLI


def cli(path: Path, overrides: list[str], wait_s: float = 600) -> int:
    """`runner preflight conf.yaml`: the same checks as a short job (Slurm) or local processes; print the table."""
    from runner import spec
    from runner.host import submit

    name = spec.load(path, overrides).name
    extra = [f"name={name}-preflight", f"env.{ONLY_ENV}=1", "preflight.enabled=true", "alerts.enabled=false",
             "slurm.requeue=false", "resume.enabled=false"]
    p = submit.plan(path, [*overrides, *extra])
    rd = p.run
    if p.scheduler == "slurm":
        submit.execute(p)
        print(f"preflight job {rd.job_id()}: waiting for {rd.preflight}", flush=True)
    else:
        submit.write(p)
        with contextlib.redirect_stdout(io.StringIO()):
            submit.run_local(rd, p.world_size)
    deadline = time.monotonic() + wait_s
    while not rd.preflight.exists():
        if rd.exit_status.exists() and not rd.preflight.exists():
            time.sleep(1.0)  # the report is written before the job exits; give a shared filesystem a moment
            if not rd.preflight.exists():
                code = (read_json(rd.exit_status) or {}).get("exit_code")
                raise PreflightError(f"preflight job ended (exit {code}) without a report in {rd.root}; expected "
                                     f"preflight.json. hint: runner logs {rd.root}")
        if time.monotonic() > deadline:
            raise PreflightError(f"no preflight report in {rd.root} after {wait_s:g} s; expected preflight.json. "
                                 "hint: is the job still pending? (squeue)")
        time.sleep(0.2)
    report = read_json(rd.preflight)
    print(table(report), end="")
    print(f"report: {rd.root / 'preflight.json'}")
    return EXIT_PREFLIGHT if report["status"] == FAIL else 0
